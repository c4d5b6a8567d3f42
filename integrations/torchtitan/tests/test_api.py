"""Single-process checks: the shipped tokenizer and synthetic data, document boundaries, the command-line config
functions (parsed by torchtitan's own ConfigManager), the model specs and the errors at each public boundary."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch


def _tokenizer():
    from magi_attention_torchtitan import tokenizer_path
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(tokenizer_path=tokenizer_path())


def test_tokenizer_round_trip() -> None:
    tok = _tokenizer()
    ids = tok.encode("the cat, 42.", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id == 0 and ids[-1] == tok.eos_id == 1
    assert tok.decode(ids[1:-1]) == "the cat, 42."
    assert tok.get_vocab_size() == 42


def test_synthetic_packing_follows_torchtitan() -> None:
    """Samples have seq_len tokens; labels are the next token inside each document (never across a document
    end); positions count from 0 at each document start, also for a document cut by the previous sample."""
    from magi_attention_torchtitan import SyntheticDocumentsDataset, document_cu_seqlens

    tok = _tokenizer()
    data = SyntheticDocumentsDataset(tok, seq_len=64, seed=3, dp_rank=0, min_doc_len=5, max_doc_len=90)
    stream: list[int] = []  # the documents as tokenized, to check the packing against
    gen = iter(data)
    samples = [next(gen) for _ in range(6)]
    replay = SyntheticDocumentsDataset(tok, seq_len=64, seed=3, dp_rank=0, min_doc_len=5, max_doc_len=90)
    while len(stream) < 6 * 64 + 200:
        stream.append(replay._next_document())
    docs_inputs = [t for d in stream for t in d[:-1]]
    docs_labels = [t for d in stream for t in d[1:]]
    for i, (x, y) in enumerate(samples):
        assert x["input"].tolist() == docs_inputs[64 * i : 64 * (i + 1)]
        assert y.tolist() == docs_labels[64 * i : 64 * (i + 1)]
        pos = x["positions"].tolist()
        assert pos[0] == 0
        cu = document_cu_seqlens(x["positions"][None], 1, 64)
        assert len(cu) > 2  # several documents per sample
        for s, e in pairwise(cu):
            assert pos[s:e] == list(range(e - s))
            # inside a document, each input's label is the next input
            assert y[s : e - 1].tolist() == x["input"][s + 1 : e].tolist()
    # the cp ranks of a replica (same dp_rank) read the same documents, another replica others
    again = next(
        iter(SyntheticDocumentsDataset(tok, seq_len=64, seed=3, dp_rank=0, min_doc_len=5, max_doc_len=90))
    )
    other = next(
        iter(SyntheticDocumentsDataset(tok, seq_len=64, seed=3, dp_rank=1, min_doc_len=5, max_doc_len=90))
    )
    assert torch.equal(again[0]["input"], samples[0][0]["input"])
    assert not torch.equal(other[0]["input"], samples[0][0]["input"])


def test_document_cu_seqlens() -> None:
    from magi_attention_torchtitan import document_cu_seqlens

    positions = torch.tensor([[0, 1, 2, 0, 1], [3, 4, 0, 1, 2]])  # row 1 starts inside a cut document
    assert document_cu_seqlens(positions, 2, 5) == (0, 3, 5, 7, 10)
    assert document_cu_seqlens(None, 2, 5) == (0, 5, 10)


@pytest.mark.parametrize(
    "config", ["magi_llama3_tiny", "magi_qwen3_tiny", "magi_llama3_debugmodel", "magi_qwen3_debugmodel"]
)
def test_config_functions_parse_on_torchtitans_command_line(config: str) -> None:
    from magi_attention_torchtitan import MagiAttention, MagiTrainer
    from torchtitan.config import ConfigManager

    parsed = ConfigManager().parse_args(
        [
            "--module",
            "magi_attention_torchtitan",
            "--config",
            config,
            "--parallelism.context_parallel_degree",
            "2",
            "--magi.rope_positions",
            "global",
            "--magi.chunk_size",
            "512",
            "--magi.dispatch_alg",
            "documents",
            "--magi.plan_in_dataloader",
            "--dataloader.num_workers",
            "1",
        ]
    )
    assert isinstance(parsed, MagiTrainer.Config)
    assert parsed.parallelism.context_parallel_degree == 2
    assert parsed.parallelism.spmd_backend == "partial_dtensor"
    assert parsed.magi.rope_positions == "global"
    assert parsed.magi.dist_attn_config().dispatch_config.chunk_size == 512
    assert parsed.magi.dist_attn_config().dispatch_config.alg == "documents"
    assert parsed.magi.plan_in_dataloader and parsed.dataloader.num_workers == 1
    inner = [layer.attention.inner_attention for layer in parsed.model_spec.model.layers]
    assert all(isinstance(a, MagiAttention.Config) for a in inner)
    # the model and the tokenizer agree
    assert parsed.model_spec.model.vocab_size >= _tokenizer().get_vocab_size()


def test_torch_without_data_parallel_mesh_dims_is_refused_naming_the_torch_needed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.11 lacks torch.distributed.fsdp.DataParallelMeshDims, which torchtitan 0.3.0 imports: the package's
    import check raises saying which torch to install (torchtitan's own ImportError does not)."""
    import importlib.util

    import magi_attention_torchtitan._torch_requirement as requirement
    import torch.distributed.fsdp

    spec = importlib.util.spec_from_file_location("torch_requirement_rerun", requirement.__file__)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # this torch passes
    monkeypatch.delattr(torch.distributed.fsdp, "DataParallelMeshDims")
    with pytest.raises(ImportError, match=r"needs torch>=2\.12 \(this is torch "):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_magi_config_rejects_bad_values() -> None:
    from magi_attention_torchtitan import MagiAttentionConfig

    from magi_attention.config import DistAttnConfig

    with pytest.raises(ValueError, match="rope_positions"):
        MagiAttentionConfig(rope_positions="absolute")
    with pytest.raises(ValueError, match="chunk_size"):
        MagiAttentionConfig(chunk_size=0)
    with pytest.raises(ValueError, match="dispatch_alg"):
        MagiAttentionConfig(dispatch_alg="whole_docs")
    # the defaults are magi's defaults; a named placement reaches the dispatch config
    assert MagiAttentionConfig().dist_attn_config() == DistAttnConfig()
    assert MagiAttentionConfig(dispatch_alg="min_heap").dist_attn_config().dispatch_config.alg == "min_heap"


def test_model_specs() -> None:
    from magi_attention_torchtitan import magi_model_spec, model_flavors, parallelize_magi

    assert {"tiny", "debugmodel", "8B"} <= set(model_flavors("llama3"))
    assert {"tiny", "debugmodel", "0.6B"} <= set(model_flavors("qwen3"))
    spec = magi_model_spec("qwen3", "0.6B")
    assert spec.parallelize_fn is parallelize_magi and spec.pipelining_fn is None
    assert spec.state_dict_adapter is not None
    with pytest.raises(ValueError, match="model must be one of"):
        magi_model_spec("gpt2", "tiny")
    with pytest.raises(ValueError, match="flavor of llama3 must be one of"):
        magi_model_spec("llama3", "1T")


def test_magi_attention_rejects_other_masks_and_batches() -> None:
    from magi_attention_torchtitan import MagiAttention

    attn = MagiAttention.Config().build()
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(TypeError, match="MagiAttentionMask"):
        attn(q, q, q, attention_masks=None)


def test_dispatch_batch_checks_shapes() -> None:
    from magi_attention_torchtitan import dispatch_batch

    ids = torch.zeros(2, 8, dtype=torch.long)
    kwargs = dict(cp_mesh=None, num_heads_q=2, num_heads_kv=2, head_dim=8)
    with pytest.raises(ValueError, match="labels must have the shape"):
        dispatch_batch(ids, ids[:, :4], positions=None, **kwargs)
    with pytest.raises(ValueError, match="positions must have the shape"):
        dispatch_batch(ids, ids, positions=ids[:1], **kwargs)
    with pytest.raises(ValueError, match="rope_positions"):
        dispatch_batch(ids, ids, positions=None, rope_positions="absolute", **kwargs)


def test_dispatch_batch_single_process() -> None:
    """Without a process group (cp 1) the batch stays whole: tokens, labels and per-document positions."""
    from magi_attention_torchtitan import dispatch_batch

    ids = torch.arange(10).view(2, 5)
    labels = ids + 100
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])
    batch = dispatch_batch(
        ids, labels, positions=positions, cp_mesh=None, num_heads_q=2, num_heads_kv=1, head_dim=8
    )
    assert batch.cu_seqlens == (0, 3, 5, 10)
    assert batch.input_ids.tolist() == [list(range(10))]
    assert batch.labels.tolist() == [list(range(100, 110))]
    assert batch.positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 4]]
    glob = dispatch_batch(
        ids,
        labels,
        positions=positions,
        cp_mesh=None,
        num_heads_q=2,
        num_heads_kv=1,
        head_dim=8,
        rope_positions="global",
    )
    assert glob.positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]]


def test_parallelize_rejects_what_it_does_not_support() -> None:
    from types import SimpleNamespace

    from magi_attention_torchtitan import parallelize_magi
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    def dims(tp=1, pp=1, ep=1):
        return SimpleNamespace(tp=tp, pp=pp, ep=ep)

    common = dict(training=TrainingConfig(), ac_config=None, dump_folder="")
    ok = ParallelismConfig(spmd_backend="partial_dtensor")
    with pytest.raises(NotImplementedError, match="tensor_parallel_degree"):
        parallelize_magi(
            None, parallel_dims=dims(tp=2), parallelism=ok, compile_config=CompileConfig(), **common
        )
    with pytest.raises(NotImplementedError, match="pipeline_parallel_degree"):
        parallelize_magi(
            None, parallel_dims=dims(pp=2), parallelism=ok, compile_config=CompileConfig(), **common
        )
    with pytest.raises(ValueError, match="partial_dtensor"):
        parallelize_magi(
            None,
            parallel_dims=dims(),
            parallelism=ParallelismConfig(),
            compile_config=CompileConfig(),
            **common,
        )
    with pytest.raises(NotImplementedError, match="compile"):
        parallelize_magi(
            None, parallel_dims=dims(), parallelism=ok, compile_config=CompileConfig(enable=True), **common
        )
