"""Ulysses sequence parallelism in JAX."""

from ulysses_jax.attention import attention
from ulysses_jax.head_layout import HeadLayout, plan_heads
from ulysses_jax.mesh import MESH_AXES, make_mesh
from ulysses_jax.ulysses import exchange_bytes, heads_to_seq, seq_to_heads, ulysses_attention

__all__ = [
    "HeadLayout",
    "MESH_AXES",
    "attention",
    "exchange_bytes",
    "heads_to_seq",
    "make_mesh",
    "plan_heads",
    "seq_to_heads",
    "ulysses_attention",
]
__version__ = "0.1.0"
