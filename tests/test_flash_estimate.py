"""The static rate estimate of the Pallas kernels (``kernels/flash_estimate.py``): its pieces against the kernels' own
loop bounds and Triton's rules, and its figures' direction (the PTX side is in ``test_gpu_compile_kernels.py``)."""

import jax.numpy as jnp
import pytest

from ulysses_jax.kernels import flash_estimate as fe
from ulysses_jax.kernels.flash_attention import kv_block_bound, q_block_range
from ulysses_jax.kernels.flash_blocks import KERNELS, BlockSizes, default_block_sizes, launch, tiles


@pytest.mark.parametrize("bq,bk,s", [(16, 32, 256), (32, 16, 256), (64, 64, 512), (128, 64, 1024)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_visited_tiles_are_the_kernels_loop_bounds(bq, bk, s, causal):
    """Counted from the kernels' own bound functions, block by block."""
    kw = {"block_q": bq, "block_k": bk, "seq_len": s, "causal": causal}
    rows = sum(int(kv_block_bound(i, **kw)) for i in range(s // bq))
    cols = sum(int(hi) - int(lo) for lo, hi in (q_block_range(j, **kw) for j in range(s // bk)))
    assert fe.visited_tiles("fwd", bq, bk, s, causal=causal) == fe.visited_tiles("dq", bq, bk, s, causal=causal) == rows
    assert fe.visited_tiles("dkv", bq, bk, s, causal=causal) == cols


def test_triton_rules_for_warpgroups_and_instructions():
    assert fe.warpgroup_split(128, 8) == (2, 1) and fe.warpgroup_split(64, 8) == (1, 2)
    mm = fe.Matmul("S", 32, 64, 128, True)
    assert fe.instruction(mm, warps=8, dtype=jnp.bfloat16) == "mma.sync"
    assert fe.instruction(fe.Matmul("S", 64, 32, 128, True), warps=8, dtype=jnp.bfloat16) == "wgmma"
    assert fe.instruction(fe.Matmul("S", 64, 32, 128, True), warps=8, dtype=jnp.float32) == "fma"


@pytest.mark.parametrize("d", [64, 128, 256])
def test_default_bf16_tiles_put_every_product_on_wgmma(d):
    blocks = default_block_sizes(d, jnp.bfloat16)
    for i, kernel in enumerate(KERNELS):
        warps = launch(blocks, i, d)[0]
        kinds = {fe.instruction(mm, warps=warps, dtype=jnp.bfloat16) for mm in fe.matmuls(kernel, *tiles(blocks, i), d)}
        assert kinds == {"wgmma"}, (kernel, kinds)
    # the queries-first dK/dV products of before (32-row query blocks) were not
    before = fe.matmuls("dkv", 32, 64, d, keys_first=False)
    assert "mma.sync" in {fe.instruction(mm, warps=8, dtype=jnp.bfloat16) for mm in before}


def test_resident_blocks():
    assert fe.resident_blocks(registers=255, threads=256, shared_memory_bytes=1024) == 1
    assert fe.resident_blocks(registers=128, threads=256, shared_memory_bytes=80_000) == 2
    assert fe.resident_blocks(registers=128, threads=256, shared_memory_bytes=120_000) == 1  # shared memory binds
    assert fe.resident_blocks(registers=32, threads=128, shared_memory_bytes=0) == 16  # 2,048 threads bind


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fractions_are_bounded_and_ordered(d, causal):
    est = fe.kernel_fractions(d, jnp.bfloat16, causal=causal, seq_len=16_384)
    for k in est.values():
        assert 0 < k.no_overlap <= k.best <= k.matmul_bound <= 1, k
        assert k.useful_fraction_of_tiles == 1 or causal
    # the keys-first dK/dV kernel is estimated faster than the queries-first one on the same tiles
    old = BlockSizes(128, 64, 32, 64, 128, 32, num_warps=8, num_stages=3)
    new = fe.kernel_fractions(d, causal=causal, block_sizes=old)["dkv"]
    before = fe.kernel_fractions(d, causal=causal, block_sizes=old, dkv_keys_first=False)["dkv"]
    assert new.matmul_bound > before.matmul_bound
    # segment ids add mask work, skip nothing
    seg = fe.kernel_fractions(d, jnp.bfloat16, causal=causal, segment_ids=True, seq_len=16_384)
    assert all(seg[n].no_overlap < est[n].no_overlap for n in KERNELS)


def test_causal_diagonal_waste_shrinks_with_length():
    short, long = (fe.kernel_fractions(128, seq_len=s)["fwd"].useful_fraction_of_tiles for s in (1024, 131_072))
    assert short < long < 1 and long > 0.99


def test_attention_fractions_in_flashattention_flops():
    a = fe.attention_fractions(128, causal=True, seq_len=16_384)
    for which in ("forward", "backward"):
        assert 0 < a[which]["no_overlap"] <= a[which]["best"] <= 1
    # the backward recomputes S in both kernels (7 products for the convention's 5): below its kernels' mean rate
    ks = fe.kernel_fractions(128, causal=True, seq_len=16_384)
    assert a["backward"]["best"] < min(ks["dkv"].best, ks["dq"].best)
    assert fe.tflops(1.0) == fe.PEAK_TFLOPS
    assert fe.flops(16_384, 128, 32, causal=False) == 2 * fe.flops(16_384, 128, 32, causal=True)
