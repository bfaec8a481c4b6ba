"""The Pallas FlashAttention kernels compiled for an H100 on a machine without a GPU (deviceless AOT).

XLA compiles the three Triton kernels (forward, dK/dV, dQ) for a compile-only H100 and runs ptxas on them
itself (``-arch=sm_90a --warn-on-spills``); ``kernels()`` reads the launches from XLA's thunk sequence and
registers / spills from ``ptxas -v`` on the same PTX. Checked: no register spills at head_dim 64 and 128 in
bfloat16 with the default (tuned) blocks, shared memory within the H100's limit per block, head_dim 256 and
float32 either fit or are refused up front, and 64-bit pointer offsets where a q/k/v passes 2^31 elements.
The non-causal case also guards a fixed bug: its dK/dV loop bound lowered to i1 and the backward did not compile.
The instruction mix is a test too: in bfloat16 every matmul of all three kernels is a Hopper ``wgmma`` (no
Ampere-style ``mma.sync`` in the PTX), as the static estimate (``kernels/flash_estimate.py``) predicts from the tiles;
cuDNN's fused attention compiles for the same target. Figures for the record: ``python experiments/kernel_ptxas.py``.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

import ulysses_jax.kernels.flash_attention as fa
from ulysses_jax.kernels import flash_blocks, flash_pair
from ulysses_jax.kernels.flash_attention import flash_attention
from ulysses_jax.kernels.flash_blocks import SHARED_MEMORY_PER_BLOCK, BlockSizes

pytestmark = pytest.mark.aot

NAMES = ("flash_attention_fwd", "flash_attention_dkv", "flash_attention_dq")


@pytest.fixture(scope="module")
def h100():
    from ulysses_jax.plan.targets import target_devices

    return target_devices("h100", devices=1)[0]


def _structs(dev, *, s, h, hkv, d, dtype, segments):
    sharding = SingleDeviceSharding(dev)
    q = jax.ShapeDtypeStruct((1, s, h, d), dtype, sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, s, hkv, d), dtype, sharding=sharding)
    seg = jax.ShapeDtypeStruct((1, s), jnp.int32, sharding=sharding) if segments else None
    return q, kv, kv, seg


def _grad_fn(*, causal=True, block_sizes=None):
    def loss(q, k, v, seg):
        out = flash_attention(q, k, v, causal=causal, segment_ids=seg, block_sizes=block_sizes, interpret=False)
        return out.astype(jnp.float32).sum()

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _compile(dev, dump_dir, *, d, dtype=jnp.bfloat16, segments=False, causal=True, s=4096, h=8, hkv=8,
             block_sizes=None):
    """Compile forward + backward for ``dev``; the three kernels' figures by name."""
    from ulysses_jax.plan.kernel_report import dump_options, kernels

    args = _structs(dev, s=s, h=h, hkv=hkv, d=d, dtype=dtype, segments=segments)
    with jax.default_device(dev):
        lowered = _grad_fn(causal=causal, block_sizes=block_sizes).trace(*args).lower()
    lowered.compile(compiler_options=dump_options(dump_dir))
    return {k.name: k for k in kernels(dump_dir, prefix="flash_attention")}


def _report(found):
    return ", ".join(f"{n}: {k.warps} warps, {k.shared_memory_bytes} B smem, {k.registers} regs, "
                     f"{k.spill_store_bytes}/{k.spill_load_bytes} B spilled, {k.wgmma} wgmma {list(k.wgmma_shapes)}, "
                     f"{k.mma_sync} mma.sync, {k.tma} TMA, {k.resident_blocks} blocks/SM" for n, k in sorted(found.items()))


def _assert_all_wgmma(found, blocks, d):
    """No ``mma.sync`` in any kernel, wgmma in each, and the static estimate predicts exactly that from the tiles."""
    from ulysses_jax.kernels.flash_estimate import instruction, matmuls

    for name, k in found.items():
        kernel = name.removeprefix("flash_attention_")
        i = flash_blocks.KERNELS.index(kernel)
        warps = flash_blocks.launch(blocks, i, d)[0]
        predicted = {instruction(mm, warps=warps, dtype=jnp.bfloat16)
                     for mm in matmuls(kernel, *flash_blocks.tiles(blocks, i), d)}
        assert predicted == {"wgmma"}, (name, predicted)
        assert k.mma_sync == 0 and k.wgmma > 0, _report(found)


# --------------------------------------------------------------------------------- registers and spills


@pytest.mark.parametrize("d,segments,causal,hkv", [
    (64, False, True, 8), (64, True, True, 8), (128, False, True, 8), (128, True, True, 8), (128, True, False, 2),
], ids=["d64", "d64-seg", "d128", "d128-seg", "d128-seg-full-gqa4"])
def test_bf16_kernels_compile_without_spills(h100, tmp_path, d, segments, causal, hkv):
    found = _compile(h100, tmp_path, d=d, segments=segments, causal=causal, hkv=hkv)
    print(f"\nD={d} bf16 seg={segments} causal={causal}: {_report(found)}")
    assert set(found) == set(NAMES), sorted(found)
    blocks = fa.default_block_sizes(d, jnp.bfloat16)
    estimate = flash_blocks.shared_memory_bytes(blocks, d, jnp.bfloat16, segment_ids=segments)
    for name, k in found.items():
        kernel = name.removeprefix("flash_attention_")
        assert k.registers is not None and 0 < k.registers <= 255, (name, k.registers)  # ptxas ran and reported
        assert (k.spill_store_bytes, k.spill_load_bytes) == (0, 0), _report(found)
        assert k.shared_memory_bytes <= SHARED_MEMORY_PER_BLOCK, _report(found)
        # the up-front estimate bounds what Triton allocates, and not loosely
        assert k.shared_memory_bytes <= estimate[kernel] <= 1.7 * k.shared_memory_bytes, (name, estimate)
        assert k.warps == flash_blocks.launch(blocks, flash_blocks.KERNELS.index(kernel), d)[0]
        assert k.resident_blocks >= 1, _report(found)
    _assert_all_wgmma(found, fa.fit_blocks(blocks, 4096), d)


def test_instruction_check_sees_mma_sync(h100, tmp_path):
    """The check above can fail: a forward query block of 32 rows (M < 64) is what Triton issues as mma.sync, and the
    estimate predicts it; the other two kernels keep wgmma."""
    from ulysses_jax.kernels.flash_estimate import instruction, matmuls

    blocks = BlockSizes(32, 64, 64, 128, 128, 64, num_warps=8, num_stages=3)
    found = _compile(h100, tmp_path, d=64, block_sizes=blocks)
    assert found["flash_attention_fwd"].mma_sync > 0 and found["flash_attention_dkv"].mma_sync == 0, _report(found)
    assert "mma.sync" in {instruction(mm, warps=8, dtype=jnp.bfloat16) for mm in matmuls("fwd", 32, 64, 64)}


@pytest.mark.parametrize("causal,float32", [(True, True), (False, True), (True, False)],
                         ids=["diag", "full", "diag-bf16-out"])
def test_ring_pair_kernels_compile_without_spills(h100, tmp_path, causal, float32):
    """The ring's variant (``pair_forward`` / ``pair_backward``: float32 outputs, separate query and key segment
    ids, the log-sum-exp given): Llama-3.1-8B's per-device ring pair at ring=4 x sp=8 (4 query heads, 1 KV head,
    head_dim 128, bfloat16), still without spills; with ``float32=False`` (the tiled attention's head groups) the
    outputs are bfloat16."""
    from ulysses_jax.plan.kernel_report import dump_options, kernels

    s, h, hkv, d = 8192, 4, 1, 128
    q, k, v, seg = _structs(h100, s=s, h=h, hkv=hkv, d=d, dtype=jnp.bfloat16, segments=True)
    rows = jax.ShapeDtypeStruct((1, h, s), jnp.float32, sharding=SingleDeviceSharding(h100))

    def both(q, k, v, seg, lse, delta):
        pos = jnp.arange(s)
        o, l = flash_pair.pair_forward(q, k, v, pos, pos, seg, seg + 1, causal=causal, scale=0.1, interpret=False,
                               float32=float32)
        grads = flash_pair.pair_backward(q, k, v, pos, pos, seg, seg + 1, o.astype(q.dtype), lse, delta, causal=causal,
                                 scale=0.1, interpret=False, float32=float32)
        return o, l, grads

    with jax.default_device(h100):
        lowered = jax.jit(both).trace(q, k, v, seg, rows, rows).lower()
    lowered.compile(compiler_options=dump_options(tmp_path))
    found = {k.name: k for k in kernels(tmp_path, prefix="flash_attention")}
    print(f"\nring pair causal={causal}: {_report(found)}")
    assert set(found) == set(NAMES), sorted(found)
    for k in found.values():
        assert k.registers is not None and (k.spill_store_bytes, k.spill_load_bytes) == (0, 0), _report(found)
        assert k.shared_memory_bytes <= SHARED_MEMORY_PER_BLOCK, _report(found)
    _assert_all_wgmma(found, fa.fit_blocks(fa.default_block_sizes(d, jnp.bfloat16), s), d)
    # the outputs are float32 (o, dq, dk, dv): what the ring merges and accumulates; else the inputs' dtype
    want = jnp.float32 if float32 else jnp.bfloat16
    assert all(x.dtype == want for x in [lowered.out_info[0], *lowered.out_info[2]])


def test_spill_check_sees_spills(h100, tmp_path):
    """The figures can fail the test above: the blocks and warps before tuning (4 warps at head_dim 64) spill."""
    found = _compile(h100, tmp_path, d=64, block_sizes=BlockSizes(num_warps=(4, 4, 4), num_stages=2))
    assert any(k.spill_store_bytes > 0 for k in found.values()), _report(found)


# --------------------------------------------------------------------------------- shared memory


@pytest.mark.parametrize("d,dtype", [(256, jnp.bfloat16), (64, jnp.float32), (128, jnp.float32)],
                         ids=["d256-bf16", "d64-f32", "d128-f32"])
def test_large_head_dim_and_float32_fit_the_shared_memory(h100, tmp_path, d, dtype):
    found = _compile(h100, tmp_path, d=d, dtype=dtype, segments=True)
    print(f"\nD={d} {jnp.dtype(dtype).name}: {_report(found)}")
    assert set(found) == set(NAMES), sorted(found)
    for k in found.values():
        assert k.shared_memory_bytes <= SHARED_MEMORY_PER_BLOCK, _report(found)
        assert k.registers is not None, _report(found)
        if dtype == jnp.bfloat16:  # float32 dots run on FMA units (full precision): ptxas may spill a few bytes
            assert k.spill_store_bytes == 0, _report(found)
    if dtype == jnp.bfloat16:
        _assert_all_wgmma(found, fa.default_block_sizes(d, dtype), d)


@pytest.mark.parametrize("d,dtype", [(256, jnp.bfloat16), (128, jnp.float32), (512, jnp.bfloat16)],
                         ids=["d256-bf16", "d128-f32", "d512-bf16-default"])
def test_tiles_over_the_shared_memory_are_refused_up_front(h100, d, dtype):
    """128 x 128 blocks at head_dim 256 (or in float32 at 128) and the defaults at head_dim 512: one ValueError
    while tracing, before anything compiles."""
    blocks = None if d == 512 else BlockSizes()
    args = _structs(h100, s=4096, h=8, hkv=8, d=d, dtype=dtype, segments=False)
    with pytest.raises(ValueError, match=r"needs about [\d,]+ bytes of shared memory per block .* over the GPU's "
                                         r"232,448: pass smaller BlockSizes"):
        with jax.default_device(h100):
            _grad_fn(block_sizes=blocks).trace(*args)


def test_refused_tiles_would_not_compile(h100, tmp_path, monkeypatch):
    """Without the check, XLA itself rejects the refused tiles: the refusal is not over-cautious there."""
    monkeypatch.setattr(fa, "check_shared_memory", lambda *a, **k: None)
    with pytest.raises(Exception, match="Shared memory size limit exceeded"):
        _compile(h100, tmp_path, d=256, block_sizes=BlockSizes())


# --------------------------------------------------------------------------------- 64-bit offsets


def _triton_modules(dev, monkeypatch, *, s, h=8, d=128):
    """The Triton IR Pallas hands to XLA for forward + backward (bfloat16, segment ids), by kernel name.
    Lowering only: nothing compiles, so lengths in the millions cost nothing."""
    from jax._src.pallas.triton import lowering

    modules = {}
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        text = result.module.operation.get_asm()
        modules[re.search(r"@(flash_attention_\w+)", text).group(1)] = text
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", capture)
    args = _structs(dev, s=s, h=h, hkv=h, d=d, dtype=jnp.bfloat16, segments=True)
    with jax.default_device(dev):
        _grad_fn().trace(*args).lower()
    return modules


def _bf16_offset_widths(text):
    """Integer widths of the offsets of every ``tt.addptr`` on a bfloat16 pointer (q, k, v, o, dO, dq, dk, dv)."""
    return re.findall(r"tt\.addptr .*!tt\.ptr<bf16>.*, tensor<[\dx]+x(i\d+)>", text)


@pytest.mark.parametrize("s", [4096, 2**21, 2**22], ids=["s4096", "s2M", "s4M"])
def test_pointer_offsets_are_64_bit_beyond_2_31_elements(h100, monkeypatch, s):
    """B=1, S, 8 heads, D=128 in bfloat16: q/k/v have S * 1024 elements. Past 2^31 elements (S = 4M: 2^32)
    every bfloat16 pointer offset in all three kernels is 64-bit. Up to 2^31 elements (S = 2M, exactly 2^31)
    32-bit offsets are used, which is exact there: each offset is a sum of non-negative index * stride terms
    bounded by the last element's offset, 2^31 - 1, the largest int32."""
    modules = _triton_modules(h100, monkeypatch, s=s)
    assert set(modules) == set(NAMES)
    elements = s * 8 * 128
    for name, text in modules.items():
        widths = set(_bf16_offset_widths(text))
        if elements > 2**31:
            assert widths == {"i64"}, (name, widths)
        else:
            assert widths == {"i32"} and elements - 1 <= 2**31 - 1, (name, widths)


def _global_bf16_widenings(ptx: str) -> int:
    """How many 32-bit element offsets of 2-byte elements (``mul.wide.s32 %rd, %r, 2``) are added to anything but
    the shared-memory base: 32-bit offsets into global memory."""
    smem = set(re.findall(r"mov\.b64\s+(%rd\d+), global_smem;", ptx))
    count = 0
    for rd in re.findall(r"mul\.wide\.s32\s+(%rd\d+), %r\d+, 2;", ptx):
        bases = {a or b for a, b in re.findall(rf"add\.s64\s+%rd\d+, (%rd\d+), {rd};|add\.s64\s+%rd\d+, {rd}, "
                                               rf"(%rd\d+);", ptx)}
        count += not bases or bool(bases - smem)
    return count


@pytest.mark.parametrize("s", [2**21, 2**22], ids=["s2M", "s4M"])
def test_ptx_addresses_global_memory_with_64_bit_offsets_beyond_2_31_elements(h100, tmp_path, s):
    """The compiled PTX agrees with the IR: at S = 4M (2^32 elements) no 32-bit element offset reaches a global
    address in any kernel (the only 32-bit index left scales a shared-memory pipeline stage); at S = 2M
    (2^31 elements, where int32 is exact) the same check finds them, so it can fail."""
    _compile(h100, tmp_path, d=128, segments=True, s=s)
    counts = {}
    for ptx in tmp_path.glob("*.ptx"):
        text = ptx.read_text()
        for name in re.findall(r"\.visible \.entry (flash_attention_\w+)\(", text):
            counts[name] = _global_bf16_widenings(text)
    assert set(counts) == set(NAMES), counts
    if s * 8 * 128 > 2**31:
        assert all(n == 0 for n in counts.values()), counts
    else:
        assert all(n > 0 for n in counts.values()), counts


# --------------------------------------------------------------------------------- cuDNN


def test_cudnn_fused_attention_compiles_forward_and_backward(h100, tmp_path):
    """What ``auto`` picks on a GPU for calls without segment ids: cuDNN's fused attention (``impl="cudnn"``),
    bfloat16, causal, GQA, head_dim 128, compiles for the H100 with one fused kernel each way."""
    from ulysses_jax.kernels.attention import attention, resolve_impl

    assert resolve_impl("auto", dtype=jnp.bfloat16, head_dim=128, has_segment_ids=False, platform="gpu") == "cudnn"
    q, k, v, _ = _structs(h100, s=4096, h=8, hkv=2, d=128, dtype=jnp.bfloat16, segments=False)

    def loss(q, k, v):
        return attention(q, k, v, causal=True, impl="auto", platform="gpu").astype(jnp.float32).sum()

    with jax.default_device(h100):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower().compile()
    calls = re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', compiled.as_text())
    assert len(calls) == 2 and any("Backward" in c for c in calls), calls


def test_dk_and_dv_are_written_into_k_and_v(h100):
    """The dK/dV kernel writes its gradients into K's and V's buffers (input_output_aliases), after the dQ kernel,
    which reads K and V whole: in the compiled H100 program its call aliases both outputs to operands 1 and 2."""
    q, k, v, seg = _structs(h100, s=4096, h=8, hkv=2, d=128, dtype=jnp.bfloat16, segments=False)
    with jax.default_device(h100):
        text = _grad_fn().trace(q, k, v, seg).lower().compile().as_text()
    calls = [line for line in text.splitlines() if "custom-call(" in line and "flash_attention_dkv" in line]
    assert len(calls) == 1, calls
    assert "output_to_operand_aliasing={{0}: (1, {}), {1}: (2, {})}" in calls[0], calls[0][:400]
