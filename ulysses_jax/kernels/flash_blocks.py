"""Block sizes of the Pallas flash-attention kernels: tiles, warps and pipeline stages per head_dim and dtype, tuned for
H100 from ptxas, and the shared memory each kernel needs.

``default_block_sizes`` gives the tuned ``BlockSizes``; ``fit_blocks`` shrinks tiles larger than a sequence;
``shared_memory_bytes`` estimates each kernel's dynamic shared memory, so that ``check_shared_memory`` can refuse
tiles over the GPU's limit per block before anything compiles. The kernels themselves are ``flash_attention.py``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

MIN_BLOCK = 16  # Triton's tl.dot needs every dimension >= 16
SHARED_MEMORY_PER_BLOCK = 232_448  # bytes, the opt-in limit per thread block of H100 and H200 (sm_90)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two >= 16) and GPU launch settings. Larger than the sequence? They shrink.

    As in Triton's fused-attention tutorial, the dK/dV kernel keeps a tall KV block and streams thin
    query blocks, the dQ kernel the reverse. ``num_warps`` / ``num_stages`` apply to the GPU (Triton)
    lowering only: one value for all three kernels, a tuple ``(forward, dK/dV, dQ)``, or ``None`` for a
    heuristic. ``flash_attention(block_sizes=None)`` uses :func:`default_block_sizes`, tuned per head_dim
    and dtype; the class defaults below are the untuned starting point.
    """

    block_q: int = 128
    block_k: int = 128
    block_q_dkv: int = 32
    block_k_dkv: int = 128
    block_q_dq: int = 128
    block_k_dq: int = 32
    num_warps: int | tuple[int, int, int] | None = None
    num_stages: int | tuple[int, int, int] | None = None


# Tuned on the H100 target (sm_90a, ptxas via XLA's deviceless compile; see experiments/kernel_ptxas.py): per
# (head_dim rounded up to a power of two, bytes per element) the six block sizes and per-kernel warps and
# stages (forward, dK/dV, dQ). Chosen as the largest tiles with no register spill at any sequence length,
# with and without segment ids, causal or not, MHA or GQA, and within the shared memory per block; in 16-bit types
# every product's M is a multiple of 64 (Hopper wgmma, no mma.sync) and, at head_dim 64 and 128, each warpgroup's N
# is >= 32. dK/dV at head_dim 128 keeps a 32-row query block: 64 rows reach 255 registers (4 bytes spilled non-causal).
_TUNED: dict[tuple[int, int], BlockSizes] = {
    (64, 2): BlockSizes(128, 128, 64, 128, 128, 64, num_warps=(8, 8, 8), num_stages=(3, 3, 3)),
    (128, 2): BlockSizes(128, 64, 32, 128, 128, 64, num_warps=(8, 8, 8), num_stages=(3, 3, 3)),
    (256, 2): BlockSizes(64, 64, 16, 64, 64, 32, num_warps=(8, 8, 8), num_stages=(2, 2, 2)),
    (64, 4): BlockSizes(64, 32, 32, 64, 64, 32, num_warps=(8, 8, 8), num_stages=(2, 1, 2)),
    (128, 4): BlockSizes(32, 32, 32, 32, 32, 32, num_warps=(8, 8, 8), num_stages=(2, 1, 2)),
    (256, 4): BlockSizes(32, 32, 16, 32, 32, 16, num_warps=(8, 8, 8), num_stages=(2, 1, 2)),
}


def default_block_sizes(head_dim: int, dtype) -> BlockSizes:
    """The tuned :class:`BlockSizes` for ``head_dim`` and ``dtype`` (``flash_attention``'s default).

    Head dims round up to the next tuned size (64, 128, 256); larger ones get the 256 entry, which
    :func:`flash_attention` then refuses on GPU if its tiles exceed the shared memory per block.
    """
    itemsize = 2 if jnp.dtype(dtype).itemsize <= 2 else 4
    dims = sorted(d for d, i in _TUNED if i == itemsize)
    d = next((d for d in dims if d >= head_dim), dims[-1])
    return _TUNED[d, itemsize]



KERNELS = ("fwd", "dkv", "dq")  # kernel i is named flash_attention_{KERNELS[i]} on the GPU


def tiles(blocks: BlockSizes, kernel: int) -> tuple[int, int]:
    """(query block, key block) of kernel 0 forward, 1 dK/dV, 2 dQ."""
    return ((blocks.block_q, blocks.block_k), (blocks.block_q_dkv, blocks.block_k_dkv),
            (blocks.block_q_dq, blocks.block_k_dq))[kernel]


def launch(blocks: BlockSizes, kernel: int, head_dim: int) -> tuple[int, int]:
    """(num_warps, num_stages) of ``kernel``: the value in ``blocks``, else 8 warps (4 for tiles of
    32 x 32 or less at head_dim <= 64) and 2 stages."""
    bq, bk = tiles(blocks, kernel)

    def pick(value, fallback):
        value = value[kernel] if isinstance(value, tuple) else value
        return fallback if value is None else value

    return (pick(blocks.num_warps, 4 if bq * bk <= 32 * 32 and head_dim <= 64 else 8),
            pick(blocks.num_stages, 2))


def shared_memory_bytes(blocks: BlockSizes, head_dim: int, dtype, *, segment_ids: bool = False) -> dict[str, int]:
    """Estimated dynamic shared memory per block of each GPU kernel, ``{"fwd": bytes, "dkv": ..., "dq": ...}``.

    Triton keeps one buffer per pipeline stage for each tile a loop streams (K and V in the forward and
    dQ kernels, Q and dO in dK/dV) plus the tiles loaded once. Checked against the compiled H100 kernels
    (experiments/kernel_ptxas.py): exact for bfloat16 forward and dQ kernels with >= 2 stages and query
    blocks >= 64, an upper bound otherwise (by at most about 1.7x in the sweeps).
    """
    e, d = jnp.dtype(dtype).itemsize, max(MIN_BLOCK, next_pow2(head_dim))
    seg = 4 if segment_ids else 0  # int32 ids of the streamed positions
    out = {}
    for i, name in enumerate(KERNELS):
        bq, bk = tiles(blocks, i)
        stages = launch(blocks, i, d)[1]
        if name == "fwd":  # Q once; K, V per stage (one stage: one K and one V tile); float32 P re-laid out
            out[name] = (e * d * (bq + 2 * bk * (stages if stages > 1 else 1)) + seg * bk * stages
                         + (4 * bq * (bk + 4) if e == 4 else 0))
        elif name == "dkv":  # K, V once; Q, dO, L, delta per stage (float32: P^T and dS^T re-laid out too)
            s = max(stages, 2)
            out[name] = e * d * (2 * bk + 2 * bq * s) + (8 + seg) * bq * s + (2 * e * bq * bk if e == 4 else 0)
        else:  # Q, dO once; K, V per stage
            out[name] = e * d * (2 * bq + 2 * bk * stages) + seg * bk * stages
    return out



def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def fit_blocks(blocks: BlockSizes, seq_len: int) -> BlockSizes:
    """Validate block sizes and shrink those larger than the (power-of-two rounded) sequence."""
    cap = max(MIN_BLOCK, next_pow2(seq_len))
    sizes = {}
    for f in dataclasses.fields(blocks):
        if f.name.startswith("block_"):
            size = getattr(blocks, f.name)
            if size < MIN_BLOCK or size & (size - 1):
                raise ValueError(f"{f.name}={size} must be a power of two >= {MIN_BLOCK}")
            sizes[f.name] = min(size, cap)
    return dataclasses.replace(blocks, **sizes)


def check_shared_memory(blocks: BlockSizes, head_dim: int, dtype, segment_ids: bool) -> None:
    """Refuse, before anything compiles, tiles whose shared memory exceeds the GPU's limit per block."""
    for name, need in shared_memory_bytes(blocks, head_dim, dtype, segment_ids=segment_ids).items():
        if need > SHARED_MEMORY_PER_BLOCK:
            raise ValueError(
                f"flash_attention_{name} at head_dim {head_dim} in {jnp.dtype(dtype).name} needs about {need:,} "
                f"bytes of shared memory per block with {blocks}, over the GPU's {SHARED_MEMORY_PER_BLOCK:,}: "
                f"pass smaller BlockSizes (block sizes or num_stages), or bfloat16 inputs")
