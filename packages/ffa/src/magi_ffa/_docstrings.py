"""The shared argument and return sections of the FFA public functions' docstrings (one text each, bound
to every backend's functions by :func:`magi_ffa.contract.public_functions`)."""

_SHARED_ARGS = """
    Args:
        q: ``[total_q, num_heads_q, head_dim]``.
        k: ``[total_k, num_heads_kv, head_dim]``, q's dtype and device; ``num_heads_q % num_heads_kv == 0``
            (GQA / MQA: query head ``h`` uses kv head ``h // (num_heads_q // num_heads_kv)``). Any strides with
            a contiguous last dimension (e.g. a view into a fused K/V buffer).
        v: like k.
        q_ranges: int32 ``[num_slices, 2]`` half-open query ranges (a tensor on q's device or the CPU, or a
            list of pairs; CPU tensors or lists avoid a device->host copy).
        k_ranges: int32 ``[num_slices, 2]`` half-open key ranges, one per slice.
        attn_type_map: int32 ``[num_slices]``: 0 FULL, 1 CAUSAL (bottom-right aligned), 2 INV_CAUSAL (top-left
            aligned), 3 BI_CAUSAL; or one type / a list of types as ``AttnMaskType`` members or names; None =
            all FULL. Slices may overlap, in q, in k and even in (query, key) pairs: the mask is their union.
        softmax_scale: score scale, default ``head_dim ** -0.5``.
        softcap: if > 0, scores become ``softcap * tanh(score / softcap)``.
        deterministic: bitwise repeatable results (the same bits for the same inputs). The forward is always
            deterministic; the backward is on the backends and masks whose capability says so, and
            ``deterministic=True`` raises ValueError, before any kernel starts, on a mask where it is not."""

_FWD_ARGS = """
        out: optional accumulator ``[total_q, num_heads_q, head_dim]`` (float32, float64 for float64 inputs, or
            q's dtype for a single final rounding) holding a partial result over other keys, given with
            ``lse``; this call's result is merged into it in place (log-sum-exp weighting) and returned.
        lse: its log-sum-exp ``[total_q, num_heads_q]``, float32 (float64 for float64 inputs), natural log;
            rows at -inf ignore ``out``'s content.
        sink: optional attention sinks, float32 ``[num_sink, num_heads_q]``: every row's softmax also counts
            the logits ``sink[:, h]``, which carry no value (``lse`` includes them; rows that see no key get
            out 0 and a finite lse). Merged into THIS call's result before the accumulate-mode merge, so a
            multi-call caller passes it to exactly one call.
        return_max_logits: also return float32 ``[num_heads_q]`` max logits: per head the largest scaled
            (soft-capped) score over this call's visible pairs (-inf when there are none; no gradient). From
            the kernel where it reports them, else a separate QK pass (``magi_ffa.ffa_max_logits``)."""

_BACKEND_ARG = """
        backend: ``"triton"`` or ``"torch"`` to run that path whatever ``MAGI_FFA_BACKEND`` says; None =
            ``MAGI_FFA_BACKEND`` or the device / dtype default (Triton for CUDA fp16/bf16, else torch)."""

_FWD_RETURNS = """

    Returns:
        ``(out, lse)``: the given accumulators, or out in q's dtype and lse float32 (float64 for float64
        inputs) ``[total_q, num_heads_q]``; rows that no slice reaches have out 0 and lse -inf (with sinks:
        the sinks' lse). With ``return_max_logits``: ``(out, lse, max_logits)``."""

_BWD_ARGS = """
    Args:
        do: ``[total_q, num_heads_q, head_dim]`` gradient of the final output, q's dtype.
        q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap: as in ``ffa_fwd``.
        out: the FINAL forward output (merged over every call), q's shape, q's dtype or float32.
        lse: the FINAL lse ``[total_q, num_heads_q]`` float32 (float64 for float64). Gradients use
            ``P = exp(S - lse)`` and ``Delta = rowsum(do * out) - dlse``, so they are exact for this call's
            keys; rows with lse -inf contribute nothing.
        deterministic: bitwise repeatable gradients (see ``ffa_fwd``; ValueError on a mask where the backend
            cannot).
        dq: optional float32 (float64 for float64) accumulator of q's shape, added to in place.
        dk: optional accumulator of k's shape, like dq.
        dv: optional accumulator of v's shape, like dq."""

_BWD_TAIL = """
        dlse: optional gradient of the FINAL lse ``[total_q, num_heads_q]`` (what a differentiable lse needs).
        sink: the sinks the forward used (``[num_sink, num_heads_q]``): also return their gradient from these
            rows, ``dsink[t, h] = -sum_i exp(sink[t, h] - lse_i) * Delta_i`` (sink's dtype); a multi-call
            caller asks for it in exactly one call.

    Returns:
        ``(dq, dk, dv)``: the given accumulators, or fresh tensors in the input dtype; with ``sink``,
        ``(dq, dk, dv, dsink)``."""

_FLEX_RETURNS = """

    Returns:
        ``(out, lse)``: out ``[total_q, num_heads_q, head_dim]`` (q's dtype, or the given ``out``), lse float32
        (float64 for float64) ``[total_q, num_heads_q]``, natural log; rows no slice reaches: out 0, lse -inf
        (with sinks: a finite lse). Differentiable with respect to q, k, v and sink (gradients also flow
        through lse; in accumulate mode also through the given out / lse). With ``return_max_logits``:
        ``(out, lse, max_logits)``."""
