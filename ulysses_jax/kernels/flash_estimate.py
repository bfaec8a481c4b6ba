"""A static estimate (not a measurement) of the Pallas flash-attention kernels' rate on an H100: the fraction of the
tensor-core peak each kernel can reach, from its tiles, instruction kinds, occupancy and causal skipping.

``kernel_fractions(head_dim, dtype, causal=..., segment_ids=..., seq_len=...)`` gives, per kernel (``fwd``, ``dkv``,
``dq``), the fraction of the dense bf16 tensor-core peak its *useful* matmul FLOPs (the unmasked half of the score
matrix when causal, as FlashAttention-3's TFLOP/s count them) run at; ``attention_fractions`` combines them into the
forward and backward rates in FlashAttention's own FLOP convention (backward = 2.5 x forward), comparable with the
published FA3 / cuDNN / FA2 figures (``docs/attention.md``). ``tflops`` turns a fraction into TFLOP/s.

The model, per (query block x key block) tile a kernel visits, on one SM:
- each matmul ``[M, K] x [K, N]`` runs as Hopper ``wgmma`` when Triton can pick it (M a multiple of 64, warps a
  multiple of 4, 16-bit inputs: Triton's rule, checked against the PTX by ``tests/test_gpu_compile_kernels.py``),
  else as Ampere-style ``mma.sync`` (assumed to reach at most ``MMA_SYNC_FRACTION`` of the wgmma peak), or on the FMA
  units for float32 (full-precision dots). Both are also bound by reading their operands from shared memory
  (128 B/clock/SM): B always, A unless it comes from registers (P and dS do); each warpgroup (wgmma, Triton's
  ``warpsPerTileV3``: M split before N) or warp (mma.sync, ``warpsPerTileV2``) reads its own slices of A and B.
- the softmax's ``exp2`` runs on the special-function units (16/clock/SM) and the other elementwise float32 work on the
  FMA units (128/clock/SM), ``ELEMENTWISE_OPS`` per score element.
- ``best``: perfect overlap of matmuls and elementwise work across the warpgroups resident on an SM (the upper bound;
  FA3 gets close with warp specialisation and ping-pong scheduling, which the Triton lowering does not do);
  ``no_overlap``: their sum (FA2-like scheduling). Where fewer than two warpgroups fit on an SM, ``best`` is
  ``no_overlap``.
- tiles: those the kernels' loop bounds visit (causal: every tile touching the diagonal is computed in full), against
  the useful pairs. Segment ids add the mask's work but skip no tile (the loop bounds are causal only), and the
  useful FLOPs are counted as for one document (packing is unknown statically).
Not modelled: memory latency and bandwidth (attention at these lengths is compute-bound), the pipeline's prologue,
wave quantisation over the 132 SMs (assumes batch x heads x blocks >> 132), clock throttling.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ulysses_jax.kernels.flash_blocks import (
    KERNELS,
    MIN_BLOCK,
    BlockSizes,
    default_block_sizes,
    launch,
    next_pow2,
    tiles,
)

# H100 SXM, per SM (CUDA C programming guide throughput table for compute capability 9.0; H100 whitepaper)
PEAK_TFLOPS = 989.4  # dense bf16 tensor-core peak: 132 SMs x 1.83 GHz x 4096 FLOP/clock
TENSOR_MACS_PER_CLOCK = 2048  # dense bf16 multiply-adds per clock per SM (wgmma)
SHARED_BYTES_PER_CLOCK = 128
SFU_PER_CLOCK = 16  # exp2 per clock per SM
FMA_PER_CLOCK = 128  # float32 add / mul / fma per clock per SM
REGISTERS_PER_SM = 65_536
SHARED_MEMORY_PER_SM = 233_472
SHARED_MEMORY_RESERVED_PER_BLOCK = 1_024  # the runtime's per-block reservation
THREADS_PER_SM = 2_048
BLOCKS_PER_SM = 32
MMA_SYNC_FRACTION = 2 / 3  # assumption: the best an Ampere-style mma.sync kernel reaches of the wgmma peak
ELEMENTWISE_OPS = 6  # float32 ops per score element beyond exp2: scale, max/rowsum or delta, subtract, multiply,
# convert to bf16 (x2 in the backward), plus MASK_OPS for each mask that applies
MASK_OPS = 2  # a compare and a select (causal or padding), or a compare and an and (segment ids)


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One product of a kernel's tile step: ``[m, k] x [k, n]``; ``a_shared``: A read from shared memory."""

    name: str
    m: int
    n: int
    k: int
    a_shared: bool


def matmuls(kernel: str, block_q: int, block_k: int, head_dim: int, *, keys_first: bool = True
            ) -> tuple[Matmul, ...]:
    """The products of one tile step of ``kernel``, in the operand order of ``flash_attention.py``;
    ``keys_first=False``: the dK/dV kernel as it was before (S = Q K^T and dP = dO V^T with the query block as M)."""
    bq, bk, d = block_q, block_k, head_dim
    if kernel == "dkv" and not keys_first:
        return (Matmul("S=QK^T", bq, bk, d, True), Matmul("dV+=P^TdO", bk, d, bq, False),
                Matmul("dP=dOV^T", bq, bk, d, True), Matmul("dK+=dS^TQ", bk, d, bq, False))
    if kernel == "fwd":
        return Matmul("S=QK^T", bq, bk, d, True), Matmul("O+=PV", bq, d, bk, False)
    if kernel == "dkv":  # keys first: every product has the KV block as M
        return (Matmul("S^T=KQ^T", bk, bq, d, True), Matmul("dV+=P^TdO", bk, d, bq, False),
                Matmul("dP^T=VdO^T", bk, bq, d, True), Matmul("dK+=dS^TQ", bk, d, bq, False))
    if kernel == "dq":
        return (Matmul("S=QK^T", bq, bk, d, True), Matmul("dP=dOV^T", bq, bk, d, True),
                Matmul("dQ+=dSK", bq, d, bk, False))
    raise ValueError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")


def instruction(mm: Matmul, *, warps: int, dtype) -> str:
    """``"wgmma"``, ``"mma.sync"`` or ``"fma"``: what Triton issues for ``mm`` (its MMA-version rule)."""
    if jnp.dtype(dtype).itemsize == 4:
        return "fma"  # float32 dots at HIGHEST precision: no tensor cores
    return "wgmma" if mm.m % 64 == 0 and warps % 4 == 0 and mm.n % 8 == 0 else "mma.sync"


def warpgroup_split(m: int, warps: int) -> tuple[int, int]:
    """(warpgroups along M, along N) of a wgmma: Triton doubles along M while M exceeds 16 rows per warp."""
    wm, wn = 4, 1  # in warps
    while wm * wn < warps:
        if m > 16 * wm:
            wm *= 2
        else:
            wn *= 2
    return wm // 4, wn


def warp_split(m: int, n: int, warps: int) -> tuple[int, int]:
    """(warps along M, along N) of an ``mma.sync`` product: Triton's ``warpsPerTileV2`` (16 x 8 per warp)."""
    wm, wn = 1, 1
    while wm * wn < warps:
        if m / 32 / wm >= n / 8 / wn and wm < m // 16:
            wm *= 2
        else:
            wn *= 2
    return wm, wn


def matmul_clocks(mm: Matmul, *, warps: int, dtype) -> float:
    """Clocks of one SM for ``mm``: tensor-core (or FMA) time, bounded below by reading the operands from shared
    memory (wgmma: each warpgroup its slices of A and B; mma.sync: each warp its slices, through ``ldmatrix``)."""
    macs = mm.m * mm.n * mm.k
    kind = instruction(mm, warps=warps, dtype=dtype)
    if kind == "fma":
        return macs / FMA_PER_CLOCK
    if kind == "mma.sync":
        wm, wn = warp_split(mm.m, mm.n, warps)
        rate = TENSOR_MACS_PER_CLOCK * MMA_SYNC_FRACTION
    else:
        wm, wn = warpgroup_split(mm.m, warps)
        rate = TENSOR_MACS_PER_CLOCK
    operand_bytes = wm * wn * mm.k * 2 * (-(-mm.m // wm) * mm.a_shared + -(-mm.n // wn))
    return max(macs / rate, operand_bytes / SHARED_BYTES_PER_CLOCK)


def resident_blocks(*, registers: int, threads: int, shared_memory_bytes: int) -> int:
    """Thread blocks resident per SM (occupancy) for a kernel's registers per thread, threads and shared memory."""
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // 256) * 256  # allocated in units of 256 registers per warp
    by_registers = (REGISTERS_PER_SM // per_warp) // warps if per_warp else BLOCKS_PER_SM
    by_shared = SHARED_MEMORY_PER_SM // (shared_memory_bytes + SHARED_MEMORY_RESERVED_PER_BLOCK)
    return min(by_registers, by_shared, THREADS_PER_SM // threads, BLOCKS_PER_SM)


def visited_tiles(kernel: str, block_q: int, block_k: int, seq_len: int, *, causal: bool) -> int:
    """Tiles (query block x key block) one head's kernel computes: the loop bounds of ``flash_attention.py``
    (``kv_block_bound`` for the forward and dQ kernels, ``q_block_range`` for dK/dV) summed over the grid."""
    nq, nk = -(-seq_len // block_q), -(-seq_len // block_k)
    if not causal:
        return nq * nk
    if kernel == "dkv":
        return sum(nq - (j * block_k) // block_q for j in range(nk))
    return sum(min(((i + 1) * block_q + block_k - 1) // block_k, nk) for i in range(nq))


@dataclasses.dataclass(frozen=True)
class KernelEstimate:
    """One kernel's estimated rate; fractions are of the dense bf16 tensor-core peak, for its useful FLOPs."""

    kernel: str
    tile: tuple[int, int]  # (query block, key block)
    instructions: tuple[str, ...]  # per matmul: wgmma, mma.sync or fma
    useful_fraction_of_tiles: float  # useful (unmasked) pairs / pairs in the visited tiles
    best: float  # matmuls and elementwise work overlapped
    no_overlap: float  # matmuls then elementwise work
    matmul_bound: float  # the matmuls alone (tensor cores, operand reads), the ceiling of ``best``


def kernel_fractions(head_dim: int, dtype=jnp.bfloat16, *, causal: bool = True, segment_ids: bool = False,
                     seq_len: int = 16_384, block_sizes: BlockSizes | None = None,
                     warpgroups_per_sm: int | None = None, dkv_keys_first: bool = True) -> dict[str, KernelEstimate]:
    """Estimated fraction of the tensor-core peak per kernel (``{"fwd", "dkv", "dq"}``), with the default (tuned)
    blocks unless ``block_sizes``; ``warpgroups_per_sm``: resident warpgroups per SM when known (from the compiled
    kernel's registers and shared memory, ``resident_blocks``), else assumed >= 2 (8 warps per block);
    ``dkv_keys_first=False`` estimates the dK/dV kernel's earlier, queries-first formulation (for comparisons)."""
    d = max(MIN_BLOCK, next_pow2(head_dim))
    blocks = block_sizes or default_block_sizes(head_dim, dtype)
    masks = int(causal) + int(segment_ids) + int(seq_len % _multiple(blocks) != 0)
    useful_pairs = seq_len * (seq_len + 1) / 2 if causal else float(seq_len) ** 2
    out = {}
    for i, kernel in enumerate(KERNELS):
        bq, bk = tiles(blocks, i)
        bq, bk = min(bq, max(MIN_BLOCK, next_pow2(seq_len))), min(bk, max(MIN_BLOCK, next_pow2(seq_len)))
        warps = launch(blocks, i, d)[0]
        mms = matmuls(kernel, bq, bk, d, keys_first=dkv_keys_first)
        kinds = tuple(instruction(mm, warps=warps, dtype=dtype) for mm in mms)
        t_mm = sum(matmul_clocks(mm, warps=warps, dtype=dtype) for mm in mms)
        elements = bq * bk
        ops = ELEMENTWISE_OPS + (2 if kernel != "fwd" else 0) + MASK_OPS * masks
        t_elem = elements / SFU_PER_CLOCK + elements * ops / FMA_PER_CLOCK
        overlap = (warpgroups_per_sm if warpgroups_per_sm is not None else warps // 4) >= 2
        tile_macs = sum(mm.m * mm.n * mm.k for mm in mms)
        useful = useful_pairs / (visited_tiles(kernel, bq, bk, seq_len, causal=causal) * elements)
        ideal = tile_macs / TENSOR_MACS_PER_CLOCK
        out[kernel] = KernelEstimate(
            kernel=kernel, tile=(bq, bk), instructions=kinds, useful_fraction_of_tiles=useful,
            best=useful * ideal / (max(t_mm, t_elem) if overlap else t_mm + t_elem),
            no_overlap=useful * ideal / (t_mm + t_elem), matmul_bound=useful * ideal / t_mm)
    return out


def _multiple(blocks: BlockSizes) -> int:
    return max(getattr(blocks, f.name) for f in dataclasses.fields(blocks) if f.name.startswith("block_"))


def attention_fractions(head_dim: int, dtype=jnp.bfloat16, *, causal: bool = True, segment_ids: bool = False,
                        seq_len: int = 16_384, block_sizes: BlockSizes | None = None, dkv_keys_first: bool = True
                        ) -> dict[str, dict[str, float]]:
    """``{"forward": {"best", "no_overlap"}, "backward": {...}}``: estimated fraction of the tensor-core peak in
    FlashAttention's FLOP convention (forward 2 products, backward 2.5 x the forward's FLOPs; causal counts half),
    so ``tflops(fraction)`` compares with published TFLOP/s. The backward's two kernels recompute S (and dK/dV
    also dP) separately: 7 products where the convention counts 5."""
    ks = kernel_fractions(head_dim, dtype, causal=causal, segment_ids=segment_ids, seq_len=seq_len,
                          block_sizes=block_sizes, dkv_keys_first=dkv_keys_first)
    out = {}
    for which in ("best", "no_overlap"):
        # time per useful product-FLOP unit: kernel with n products at fraction f takes n / f units
        fwd = getattr(ks["fwd"], which)
        bwd_time = 4 / getattr(ks["dkv"], which) + 3 / getattr(ks["dq"], which)
        out.setdefault("forward", {})[which] = fwd
        out.setdefault("backward", {})[which] = 5 / bwd_time
    return out


def tflops(fraction: float) -> float:
    """TFLOP/s on an H100 SXM at ``fraction`` of the dense bf16 peak."""
    return fraction * PEAK_TFLOPS


def flops(seq_len: int, head_dim: int, heads: int, batch: int = 1, *, causal: bool = True, backward: bool = False
          ) -> float:
    """FlashAttention's FLOP count of one call: ``4 B H S^2 D`` forward (halved when causal), 2.5 x for the
    backward."""
    f = 4 * batch * heads * seq_len**2 * head_dim / (2 if causal else 1)
    return f * 2.5 if backward else f

