"""Ulysses x ring through the public API (``make_mesh(ring=...)``, ``ulysses_attention``) on fake CPU devices,
against the float64 NumPy reference: global arrays in their natural order in, the same out."""

import itertools
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from np_reference import TOL, attention_f64, random_inputs, rel_err

from ulysses_jax import make_mesh, ulysses_attention
from ulysses_jax.parallel.ring import zigzag_order
from ulysses_jax.parallel.ulysses import ring_token_order

B, S, D = 2, 64, 16
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1), "h6": (6, 3)}  # h6: heads not divisible by sp=4
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # see test_ring.py: same HLO, faster CPU compiles


def run_case(ring, sp, heads, causal, use_seg, dtype, impl, seed, *, data=1):
    """Loss ``sum(out * do)`` and its gradients through ``ulysses_attention`` on a ``data x ring x sp`` mesh,
    checked against the reference; returns the relative errors."""
    mesh = make_mesh(data=data, fsdp=1, ring=ring, sp=sp, devices=jax.devices()[: data * ring * sp])
    h, hkv = HEADS[heads]
    b = B * data
    q, k, v, do, seg = random_inputs(seed, b, S, h, hkv, D, jnp.dtype(dtype), shard=S // (2 * ring * sp))
    seg = seg if use_seg else None
    if use_seg:  # some document crosses a ring boundary in the zigzag layout
        owner = np.argsort(zigzag_order(S, ring)) // (S // ring)
        assert any(len(set(owner[np.asarray(seg)[r] == i])) > 1 for r in range(b) for i in range(3))

    def loss(q, k, v):
        out = ulysses_attention(q, k, v, mesh=mesh, causal=causal, segment_ids=seg, impl=impl)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

    fn = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (_, out), grads = jax.jit(fn).lower(q, k, v).compile(FAST_COMPILE)(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref_out, ref_grads = attention_f64(q, k, v, do, causal=causal, segment_ids=seg)
    errs = {"out": rel_err(out, ref_out)} | {f"d{n}": rel_err(g, rg) for n, g, rg in zip("qkv", grads, ref_grads)}
    for g, rg in zip(grads, ref_grads):
        assert g.shape == rg.shape and g.dtype == q.dtype
    print(f"ring={ring} sp={sp} {heads} causal={causal} seg={use_seg} {dtype} {impl}: "
          + " ".join(f"{k} {e:.1e}" for k, e in errs.items()))
    assert max(errs.values()) < TOL[dtype], errs
    return errs


# every (ring, sp) that fits 8 devices x every head layout, in three mask settings; dtype and kernel rotate
SHAPES = [(2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1)]
MASKS = [(True, True), (True, False), (False, True)]
GRID = [
    (ring, sp, heads, causal, use_seg)
    for (ring, sp), heads, (causal, use_seg) in itertools.product(SHAPES, HEADS, MASKS)
    if not (heads == "h6" and sp == 1)  # h6 matters where sp does not divide the heads
]
MATRIX = [(*c, ["float32", "bfloat16"][j % 2], ["xla", "blockwise", "pallas"][j // 2 % 3]) for j, c in enumerate(GRID)]
# the default suite: one case in 13, every ring size, sp size, head layout, mask, dtype and kernel
QUICK = MATRIX[4::13]


def case_id(c):
    ring, sp, heads, causal, use_seg, dtype, impl = c
    return f"ring{ring}xsp{sp}-{heads}-{'causal' if causal else 'full'}-{'seg' if use_seg else 'noseg'}-{dtype}-{impl}"


@pytest.mark.parametrize("case", QUICK, ids=case_id)
def test_matches_reference(case, seed):
    run_case(*case, seed=seed)


def test_quick_cases_cover_every_kernel_shape_layout_and_dtype():
    for i, values in enumerate(zip(*MATRIX)):
        if i in (0, 1, 2, 5, 6):  # ring, sp, heads, dtype, kernel
            assert set(values) == {c[i] for c in QUICK}, i
    assert {c[3:5] for c in QUICK} == set(MASKS)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in MATRIX if c not in QUICK], ids=case_id)
def test_matches_reference_full_grid(case, seed):
    run_case(*case, seed=seed)


def test_batch_over_data_with_a_ring(seed):
    """data=2 x ring=2 x sp=2: the batch splits over data, the sequence over ring x sp."""
    run_case(2, 2, "gqa", True, True, "float32", "xla", seed, data=2)


def test_permuted_inputs_and_output_sharding(seed):
    """``permuted=True``: inputs already in the ring's token order give the permuted output (the model's way);
    the output is sharded over ``(ring, sp)``; a ring of one is the plain Ulysses path."""
    mesh = make_mesh(fsdp=1, ring=2, sp=4)
    q, k, v, _, seg = random_inputs(seed, B, S, 8, 2, D, jnp.float32)
    perm = ring_token_order(S, 2)
    assert ring_token_order(S, 1) is None and (perm == zigzag_order(S, 2)).all()
    attend = jax.jit(lambda q, k, v, s: ulysses_attention(q, k, v, mesh=mesh, segment_ids=s, permuted=True))
    out = attend(q[:, perm], k[:, perm], v[:, perm], seg[:, perm])
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, ("ring", "sp"), None, None)), 4)
    ref = attention_f64(q, k, v, segment_ids=seg)
    assert rel_err(np.asarray(out)[:, np.argsort(perm)], ref) < TOL["float32"]
    plain = jax.jit(lambda q, k, v, s: ulysses_attention(q, k, v, mesh=make_mesh(fsdp=2, sp=4), segment_ids=s))
    assert "collective-permute" not in plain.lower(q, k, v, seg).compile(FAST_COMPILE).as_text()
    assert rel_err(plain(q, k, v, seg), ref) < TOL["float32"]


def test_errors_name_the_axes():
    mesh = make_mesh(fsdp=1, ring=4, sp=2)
    x = jnp.ones((1, 24, 4, 8))  # 24: a multiple of ring x sp = 8 and of 2 x ring = 8
    with pytest.raises(ValueError, match=r"sequence length \(20\) must be divisible by ring x sp \(4 x 2\) and by "
                                         r"2 x ring \(8, the zigzag order\)"):
        ulysses_attention(x[:, :20], x[:, :20], x[:, :20], mesh=mesh)
    with pytest.raises(ValueError, match=r"attention impl='cudnn' has no ring kernel; with a ring use one of 'xla', "
                                         r"'blockwise', 'pallas', 'auto'"):
        ulysses_attention(x, x, x, mesh=mesh, impl="cudnn")


SIXTEEN = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, "tests")
    import jax
    from test_ulysses_ring import run_case
    out = {}
    for case in json.loads(sys.argv[1]):
        out["-".join(map(str, case))] = run_case(*case, seed=int(sys.argv[2]))
    print(json.dumps(out))
""")
SIXTEEN_CASES = [  # ring x sp on 16 devices
    (4, 4, "gqa", True, True, "float32", "xla"),
    (8, 2, "mqa", True, True, "bfloat16", "blockwise"),
    (4, 4, "h6", False, True, "float32", "blockwise"),
    (8, 2, "mha", True, False, "float32", "xla"),
]


@pytest.mark.slow
def test_sixteen_devices_in_a_subprocess(seed):
    """ring=4 x sp=4 and ring=8 x sp=2 need 16 fake devices: a fresh process (this one has 8)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=16", JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", SIXTEEN, json.dumps(SIXTEEN_CASES), str(seed)], env=env,
                         capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]
    errs = json.loads(res.stdout.strip().splitlines()[-1])
    print(json.dumps(errs, indent=1))
    assert len(errs) == len(SIXTEEN_CASES)
