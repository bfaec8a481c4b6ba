"""Ulysses attention on fake CPU devices against the float64 NumPy reference and the SP=1 path."""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from np_reference import TOL, attention_f64, random_inputs, rel_err

from ulysses_jax import attention, exchange_bytes, make_mesh, plan_heads, ulysses_attention

MESHES = {  # name -> (data, fsdp, sp); sp-only meshes use the first sp devices
    "sp1": (1, 1, 1),
    "sp2": (1, 1, 2),
    "sp4": (1, 1, 4),
    "sp8": (1, 1, 8),
    "fsdp2xsp4": (1, 2, 4),
    "fsdp4xsp2": (1, 4, 2),
    "data2xfsdp2xsp2": (2, 2, 2),
}
HEADS = {  # name -> (H, Hkv)
    "mha": (8, 8),
    "gqa": (8, 4),
    "kv<sp": (8, 2),  # fewer kv heads than sp=4/8: KV heads copied
    "mqa": (8, 1),
    "kv3": (6, 3),  # kv heads not dividing sp; H=6 not divisible by sp=4/8 either
    "h12": (12, 4),  # query heads not divisible by sp=8
}
B, S, D = 4, 64, 16


def mesh_for(name):
    data, fsdp, sp = MESHES[name]
    return make_mesh(data=data, fsdp=fsdp, sp=sp, devices=jax.devices()[: data * fsdp * sp])


def loss_single(q, k, v, do, seg, causal):
    q, k, v, do = (jax.device_put(x, jax.devices()[0]) for x in (q, k, v, do))
    out = attention(q, k, v, causal=causal, segment_ids=None if seg is None else jax.device_put(seg, jax.devices()[0]))
    return jnp.sum(out * do), out


def run_case(mesh_name, heads, causal, use_seg, dtype, presharded, jitted, seed):
    mesh = mesh_for(mesh_name)
    sp = mesh.shape["sp"]
    h, hkv = HEADS[heads]
    q, k, v, do, seg = random_inputs(seed, B, S, h, hkv, D, jnp.dtype(dtype), shard=S // sp)
    seg = seg if use_seg else None
    if use_seg and sp > 1:  # some document crosses a shard boundary
        bounds = np.arange(S // sp, S, S // sp)
        assert np.any(np.asarray(seg)[:, bounds - 1] == np.asarray(seg)[:, bounds])
    batch = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1) or None
    if presharded:
        q, k, v = (jax.device_put(x, NamedSharding(mesh, P(batch, "sp"))) for x in (q, k, v))
        seg = None if seg is None else jax.device_put(seg, NamedSharding(mesh, P(batch, "sp")))

    def loss(q, k, v):
        out = ulysses_attention(q, k, v, mesh=mesh, causal=causal, segment_ids=seg)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

    fn = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (_, out), grads = (jax.jit(fn) if jitted else fn)(q, k, v)

    assert out.shape == q.shape and out.dtype == q.dtype
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(batch, "sp", None, None)), 4)
    ref_out, ref_grads = attention_f64(q, k, v, do, causal=causal, segment_ids=seg)
    tol = TOL[dtype]
    assert rel_err(out, ref_out) < tol
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert g.shape == rg.shape and rel_err(g, rg) < tol, name

    if dtype == "float32":  # SP=P equals SP=1 (the single-device XLA path)
        single = jax.jit(jax.value_and_grad(lambda *a: loss_single(*a, do, seg, causal), argnums=(0, 1, 2), has_aux=True))
        (_, single_out), single_grads = single(q, k, v)
        np.testing.assert_allclose(out, single_out, rtol=1e-5, atol=1e-5)
        for g, sg in zip(grads, single_grads):
            np.testing.assert_allclose(g, sg, rtol=1e-5, atol=1e-5)


# Every mesh x every head layout, in two mask settings, jitted; dtype and pre-sharding rotate.
MATRIX = [
    (mesh_name, heads, causal, use_seg, ["float32", "bfloat16"][i % 2], bool(i // 2 % 2), True)
    for i, (mesh_name, heads, (causal, use_seg)) in enumerate(
        itertools.product(MESHES, HEADS, [(True, True), (False, False)])
    )
]
# One layout in the full product of the other switches (jitted), plus eager (un-jitted) calls,
# which are slow on CPU (op-by-op dispatch of the backward), in a few combinations.
FULL = [
    ("fsdp2xsp4", "kv<sp", causal, use_seg, dtype, presharded, True)
    for causal, use_seg, dtype, presharded in itertools.product([True, False], [True, False], ["float32", "bfloat16"], [True, False])
]
EAGER = [
    ("fsdp2xsp4", "kv<sp", True, True, "float32", False, False),
    ("sp4", "h12", False, True, "bfloat16", True, False),
    ("data2xfsdp2xsp2", "mqa", True, False, "float32", True, False),
]


def case_id(c):
    mesh_name, heads, causal, use_seg, dtype, presharded, jitted = c
    return "-".join(
        [mesh_name, heads, "causal" if causal else "full", "seg" if use_seg else "noseg", dtype,
         "sharded" if presharded else "unsharded", "jit" if jitted else "eager"]
    )


# The default suite keeps one case per head layout (each on another mesh, float32: the SP=P == SP=1 check, causal with
# segment ids) and one bfloat16 case without a mask; the rest of the grid, and the eager calls (op-by-op backward,
# ~15 s each; the eager forward stays in notebook 01 and test_model.py::test_default_positions), run in
# `make test-slow`.
DEFAULT = {
    "sp2-mha-causal-seg-float32-unsharded-jit",
    "sp4-kv3-causal-seg-float32-unsharded-jit",
    "sp8-h12-causal-seg-float32-sharded-jit",
    "fsdp2xsp4-kv<sp-causal-seg-float32-sharded-jit",
    "fsdp4xsp2-gqa-causal-seg-float32-sharded-jit",
    "data2xfsdp2xsp2-mqa-causal-seg-float32-sharded-jit",
    "sp4-h12-full-noseg-bfloat16-sharded-jit",
}
CASES = [c if case_id(c) in DEFAULT else pytest.param(c, marks=pytest.mark.slow) for c in MATRIX + FULL + EAGER]


def test_default_cases_exist():
    assert DEFAULT <= {case_id(c) for c in MATRIX + FULL + EAGER}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(case, seed):
    run_case(*case, seed=seed)


HLO_SHAPE = re.compile(r"\b(f64|f32|bf16|f16|s32)\[([\d,]*)\]")
ITEMSIZE = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4}


def collectives(hlo_text, op):
    """[(bytes of the op's result buffers on one device)] for each ``op`` instruction in the HLO."""
    found = []
    for line in hlo_text.splitlines():
        if f" {op}(" not in line or "=" not in line:
            continue
        result_type = line.split("=", 1)[1].split(f" {op}(")[0]
        found.append(sum(ITEMSIZE[t] * int(np.prod([int(x) for x in dims.split(",") if x])) for t, dims in HLO_SHAPE.findall(result_type)))
    return found


@pytest.mark.parametrize("h, hkv", [(8, 2), (8, 4), (12, 4)], ids=["gqa-kv-copied", "gqa-contiguous", "h12-padded"])
def test_hlo_two_all_to_alls_with_formula_bytes(h, hkv, seed):
    mesh = mesh_for("fsdp2xsp4")
    q, k, v, _, seg = random_inputs(seed, B, S, h, hkv, D, jnp.float32)
    fwd = jax.jit(lambda q, k, v, seg: ulysses_attention(q, k, v, mesh=mesh, segment_ids=seg))
    hlo = fwd.lower(q, k, v, seg).compile().as_text()
    a2a = collectives(hlo, "all-to-all")
    layout = plan_heads(h, hkv, 4)
    want = exchange_bytes(layout, batch=B // 2, seq_len=S, head_dim=D, itemsize=4)
    assert a2a == [want["qkv"], want["out"]]
    # hand-computed for the first case: local batch 2, 16 tokens per device, D=16, fp32;
    # per device 2 query heads + 1 KV head (each KV head copied to 2 of the 4 devices)
    if (h, hkv) == (8, 2):
        assert want == {"qkv": 2 * 16 * 4 * (2 + 1 + 1) * 16 * 4, "out": 2 * 16 * 4 * 2 * 16 * 4,
                        "sent_fraction_num": 3, "sent_fraction_den": 4}
    assert collectives(hlo, "all-reduce") == []
    assert collectives(hlo, "all-gather") == [B // 2 * S * 4]  # the segment ids, int32

    # forward + backward: Q, K, V and O cross once each way, and the transposes move the same bytes
    grad = jax.jit(jax.grad(lambda q, k, v: (ulysses_attention(q, k, v, mesh=mesh) ** 2).sum(), argnums=(0, 1, 2)))
    a2a_grad = collectives(grad.lower(q, k, v).compile().as_text(), "all-to-all")
    assert sorted(a2a_grad) == sorted([want["qkv"], want["out"]] * 2)


@pytest.mark.parametrize(
    "mesh_name, shapes, seg_shape, match",
    [
        ("sp4", ((4, 30, 8, 16), (4, 30, 2, 16)), None, r"sequence length \(30\) must be divisible by sp \(4\)"),
        ("fsdp2xsp4", ((3, 64, 8, 16), (3, 64, 2, 16)), None, r"batch \(3\) must be divisible by .*fsdp=2 = 2"),
        ("sp4", ((4, 64, 8, 16), (4, 32, 2, 16)), None, r"k/v shape \(4, 32, 2, 16\) does not match q shape"),
        ("sp4", ((4, 64, 8, 16), (4, 64, 3, 16)), None, r"query heads \(8\) must be a multiple of kv heads \(3\)"),
        ("sp4", ((4, 64, 8, 16), (4, 64, 2, 8)), None, r"k/v shape .* does not match q shape"),
        ("sp4", ((4, 64, 8, 16), (4, 64, 2, 16)), (4, 32), r"segment_ids must have shape \[batch, seq\] = \(4, 64\)"),
    ],
)
def test_invalid_inputs(mesh_name, shapes, seg_shape, match):
    mesh = mesh_for(mesh_name)
    q, kv = jnp.ones(shapes[0]), jnp.ones(shapes[1])
    seg = None if seg_shape is None else jnp.zeros(seg_shape, jnp.int32)
    with pytest.raises(ValueError, match=match):
        ulysses_attention(q, kv, kv, mesh=mesh, segment_ids=seg)


def test_unknown_axis_name():
    with pytest.raises(ValueError, match=r"axis_name 'seq' is not an axis of the mesh \('data', 'fsdp', 'ring', 'sp'\)"):
        ulysses_attention(jnp.ones((1, 8, 2, 4)), jnp.ones((1, 8, 2, 4)), jnp.ones((1, 8, 2, 4)),
                          mesh=mesh_for("sp2"), axis_name="seq")


@pytest.mark.parametrize(
    "mesh_name, heads, dtype", [("fsdp2xsp4", "kv<sp", "float32"), ("sp8", "h12", "bfloat16")], ids=["kv-copied", "padded"]
)
def test_pallas_kernel_inside_ulysses(mesh_name, heads, dtype, seed):
    """Our Pallas kernel (interpret mode on CPU) between the two all-to-alls, against float64."""
    mesh = mesh_for(mesh_name)
    h, hkv = HEADS[heads]
    q, k, v, do, seg = random_inputs(seed, B, S, h, hkv, D, jnp.dtype(dtype), shard=S // mesh.shape["sp"])
    fn = jax.jit(lambda q, k, v: jax.vjp(lambda *a: ulysses_attention(*a, mesh=mesh, segment_ids=seg, impl="pallas"), q, k, v))
    out, vjp = fn(q, k, v)
    ref_out, ref_grads = attention_f64(q, k, v, do, segment_ids=seg)
    assert rel_err(out, ref_out) < TOL[dtype]
    for g, rg in zip(vjp(do), ref_grads):
        assert rel_err(g, rg) < TOL[dtype]


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_inputs_in_other_shardings(jitted, seed):
    """Inputs split on heads, replicated, misplaced, or (eagerly) committed to one device: same result.

    Under the caller's ``jax.jit``, an argument committed to a device outside the mesh is refused by
    ``jit`` itself before our code runs (JAX's rule for committed arguments), so that case is eager only.
    """
    mesh = mesh_for("fsdp2xsp4")
    q, k, v, _, seg = random_inputs(seed, B, S, 8, 4, D, jnp.float32, shard=S // 4)
    want = attention_f64(q, k, v, segment_ids=seg)
    placements = [
        NamedSharding(mesh, P(None, None, "sp")),  # split on heads instead of sequence
        NamedSharding(mesh, P()),  # replicated everywhere
        NamedSharding(mesh, P("sp", "fsdp")),  # batch and sequence on the wrong axes
    ] + ([] if jitted else [jax.sharding.SingleDeviceSharding(jax.devices()[3])])  # committed to one device
    fn = lambda q, k, v, s: ulysses_attention(q, k, v, mesh=mesh, segment_ids=s)  # noqa: E731
    fn = jax.jit(fn) if jitted else fn
    for sh in placements:
        args = [jax.device_put(x, sh) for x in (q, k, v)]
        seg_sh = sh if not isinstance(sh, NamedSharding) else NamedSharding(mesh, P(*sh.spec[:2]))
        out = fn(*args, jax.device_put(seg, seg_sh))
        assert rel_err(out, want) < TOL["float32"], sh
