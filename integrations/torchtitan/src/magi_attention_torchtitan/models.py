"""Model specs of torchtitan's Llama 3 and Qwen 3 with magi attention, plus a tiny flavor of each.

`magi_model_spec("llama3", "8B")` is torchtitan's own Llama 3 8B config with every inner attention converted to
`MagiAttention`, torchtitan's state-dict adapter (Hugging Face checkpoints load as usual), and
`parallelize_magi` as its parallelize function. The "tiny" flavors (a few hundred thousand parameters, vocab 64,
which covers the tokenizer shipped here) are for CPU runs and tests.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn
from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear
from torchtitan.models.common.config_utils import get_attention_config, make_ffn_config, make_gqa_config
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.llama3 import Llama3Model, llama3_configs
from torchtitan.models.llama3.model import Llama3TransformerBlock
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.models.qwen3 import Qwen3Model, qwen3_configs
from torchtitan.models.qwen3.model import Qwen3TransformerBlock
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec

from .attention import MagiAttentionConverter
from .parallelize import parallelize_magi

__all__ = ["MODELS", "magi_model_spec", "model_flavors"]

_LINEAR_INIT = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
_NORM_INIT = {"weight": nn.init.ones_}
_EMBEDDING_INIT = {"weight": partial(nn.init.normal_, std=1.0)}
TINY_VOCAB = 64


def _llama3_tiny(attn_backend: str) -> Llama3Model.Config:
    """Llama 3 layout (fused QKV, complex RoPE): dim 64, 2 layers, 4 query / 2 key-value heads of dim 16."""
    dim, n_heads, n_kv_heads = 64, 4, 2
    layers = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
            attention=make_gqa_config(
                dim=dim,
                n_heads=n_heads,
                n_kv_heads=n_kv_heads,
                wqkv_param_init=_LINEAR_INIT,
                wo_param_init=_LINEAR_INIT,
                inner_attention=get_attention_config(attn_backend),
                fuse_qkv=True,
                rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=4096, theta=500000),
            ),
            feed_forward=make_ffn_config(
                dim=dim, hidden_dim=128, w1_param_init=_LINEAR_INIT, w2w3_param_init=_LINEAR_INIT
            ),
        )
        for _ in range(2)
    ]
    return Llama3Model.Config(
        dim=dim,
        vocab_size=TINY_VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=TINY_VOCAB, embedding_dim=dim, param_init=_EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=TINY_VOCAB, param_init=_LINEAR_INIT),
        layers=layers,
    )


def _qwen3_tiny(attn_backend: str) -> Qwen3Model.Config:
    """Qwen 3 layout (QK norm, cos/sin RoPE, tied embeddings): dim 64, 2 layers, 4 query / 2 key-value heads
    of dim 32 (head_dim != dim / heads, so the softmax scale is passed explicitly)."""
    dim, n_heads, n_kv_heads, head_dim = 64, 4, 2, 32

    def norm(size: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=size, eps=1e-6, param_init=_NORM_INIT)

    layers = [
        Qwen3TransformerBlock.Config(
            attention_norm=norm(dim),
            ffn_norm=norm(dim),
            attention=make_gqa_config(
                dim=dim,
                n_heads=n_heads,
                n_kv_heads=n_kv_heads,
                head_dim=head_dim,
                wqkv_param_init=_LINEAR_INIT,
                wo_param_init=_LINEAR_INIT,
                inner_attention=get_attention_config(attn_backend),
                fuse_qkv=True,
                rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=4096, theta=1000000.0),
                qk_norm=norm(head_dim),
            ),
            feed_forward=make_ffn_config(
                dim=dim, hidden_dim=128, w1_param_init=_LINEAR_INIT, w2w3_param_init=_LINEAR_INIT
            ),
        )
        for _ in range(2)
    ]
    return Qwen3Model.Config(
        dim=dim,
        vocab_size=TINY_VOCAB,
        enable_weight_tying=True,
        tok_embeddings=Embedding.Config(
            num_embeddings=TINY_VOCAB, embedding_dim=dim, param_init=_EMBEDDING_INIT
        ),
        norm=norm(dim),
        lm_head=Linear.Config(in_features=dim, out_features=TINY_VOCAB, param_init=_LINEAR_INIT),
        layers=layers,
    )


_FLAVORS: dict[str, dict[str, Callable]] = {
    "llama3": {"tiny": _llama3_tiny, **llama3_configs},
    "qwen3": {"tiny": _qwen3_tiny, **qwen3_configs},
}
MODELS = tuple(_FLAVORS)
"""The model families: "llama3", "qwen3"."""


def model_flavors(model: str) -> tuple[str, ...]:
    """The flavors of `model`: "tiny" and torchtitan's own ("debugmodel", "8B", ...)."""
    if model not in _FLAVORS:
        raise ValueError(f"model must be one of {sorted(_FLAVORS)}, got {model!r}")
    return tuple(_FLAVORS[model])


def magi_model_spec(model: str, flavor: str) -> ModelSpec:
    """torchtitan's `ModelSpec` of `model` / `flavor` with magi attention in every attention layer.

    Args:
        model: "llama3" or "qwen3".
        flavor: one of `model_flavors(model)`.

    Returns:
        A spec whose model config has `MagiAttention` inner attentions, whose `parallelize_fn` is
        `parallelize_magi` and which has no pipelining function; the state-dict adapter is torchtitan's.
    """
    flavors = _FLAVORS.get(model)
    if flavors is None:
        raise ValueError(f"model must be one of {sorted(_FLAVORS)}, got {model!r}")
    if flavor not in flavors:
        raise ValueError(f"flavor of {model} must be one of {sorted(flavors)}, got {flavor!r}")
    # the attention backend only picks the inner attention, which the converter replaces
    config = MagiAttentionConverter.Config().build().convert(flavors[flavor](attn_backend="flex"))
    return ModelSpec(
        name=model,
        flavor=flavor,
        model=config,
        parallelize_fn=parallelize_magi,
        pipelining_fn=None,
        post_optimizer_build_fn=register_moe_load_balancing_hook if model == "qwen3" else None,
        state_dict_adapter=Llama3StateDictAdapter if model == "llama3" else Qwen3StateDictAdapter,
    )
