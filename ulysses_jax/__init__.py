"""Ulysses sequence parallelism in JAX."""

from ulysses_jax.data.sft import SFTExample, SFTRenderer
from ulysses_jax.data.tokenizers import TokenizerConventions, tokenizer_conventions
from ulysses_jax.interop.hf import from_hf, to_hf
from ulysses_jax.kernels.attention import attention
from ulysses_jax.model.config import ModelConfig, RopeScaling
from ulysses_jax.model.flops import flops_per_device, flops_per_token, mfu, param_count, peak_flops, training_flops
from ulysses_jax.model.loss import IGNORE, LossOutput, next_token_loss, shift_labels
from ulysses_jax.model.transformer import Transformer
from ulysses_jax.parallel.exchange import exchange_bytes, heads_to_seq, seq_to_heads
from ulysses_jax.parallel.head_layout import HeadLayout, plan_heads
from ulysses_jax.parallel.mesh import MESH_AXES, make_mesh
from ulysses_jax.parallel.sharding import LOGICAL_AXES, format_param_table, param_shardings, param_table
from ulysses_jax.parallel.ulysses import ulysses_attention

__all__ = [
    "HeadLayout",
    "IGNORE",
    "LOGICAL_AXES",
    "LossOutput",
    "MESH_AXES",
    "ModelConfig",
    "RopeScaling",
    "SFTExample",
    "SFTRenderer",
    "TokenizerConventions",
    "Transformer",
    "attention",
    "exchange_bytes",
    "flops_per_device",
    "flops_per_token",
    "format_param_table",
    "from_hf",
    "heads_to_seq",
    "make_mesh",
    "mfu",
    "next_token_loss",
    "param_count",
    "param_shardings",
    "param_table",
    "peak_flops",
    "plan_heads",
    "seq_to_heads",
    "shift_labels",
    "to_hf",
    "tokenizer_conventions",
    "training_flops",
    "ulysses_attention",
]
__version__ = "0.1.0"
