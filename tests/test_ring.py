"""Ring attention (``ulysses_jax.parallel.ring``) on fake CPU devices against the float64 NumPy reference."""

import collections
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from np_reference import TOL, attention_f64, random_inputs, rel_err

from ulysses_jax.parallel.head_layout import plan_heads
from ulysses_jax.parallel.ring import (
    BLOCKWISE_KERNEL,
    DIAG,
    FULL,
    PALLAS_INTERPRET_KERNEL,
    SKIP,
    XLA_KERNEL,
    LocalKernel,
    ring_attention,
    ring_permute_bytes,
    ring_schedule,
    ring_work,
    sequence_order,
    ulysses_ring_local,
    xla_forward,
    zigzag_inverse,
    zigzag_order,
)
from ulysses_jax.plan.hlo import array_bytes, parse

B, S, D = 2, 64, 16
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
# LLVM at -O0: XLA's HLO passes run as usual (same collectives), and CPU compiles are ~3x faster
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def run_jitted(fn, *args):
    return jax.jit(fn).lower(*args).compile(FAST_COMPILE)(*args)


def ring_mesh(ring, sp=1):
    devices = jax.devices()[: ring * sp]
    return jax.make_mesh((ring, sp), ("ring", "sp"), axis_types=(AxisType.Auto,) * 2, devices=devices)


def rank_of_token(order, ring):
    """For each token of the original sequence, the ring rank that holds it."""
    return np.argsort(sequence_order(order, S, ring)) // (S // ring)


def sequence_parallel(fn, mesh, order, ring, use_seg, seg, check_vma=True):
    """``fn`` on the local blocks of global ``q, k, v`` (original order): permute once, shard over
    ``("ring", "sp")``, unpermute the output: a function of the global inputs, differentiable."""
    perm = sequence_order(order, S, ring)
    inv = np.argsort(perm)
    spec = P(None, ("ring", "sp"))
    sharded = jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * (4 if use_seg else 3), out_specs=spec,
                            check_vma=check_vma)

    def attend(q, k, v):
        args = [x[:, perm] for x in (q, k, v)] + ([seg[:, perm]] if use_seg else [])
        return sharded(*args)[:, inv]

    return attend


def check_against_reference(attend, q, k, v, do, seg, causal, dtype):
    def loss(q, k, v):
        out = attend(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

    (_, out), grads = run_jitted(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref_out, ref_grads = attention_f64(q, k, v, do, causal=causal, segment_ids=seg)
    errs = {"out": rel_err(out, ref_out)} | {f"d{n}": rel_err(g, rg) for n, g, rg in zip("qkv", grads, ref_grads)}
    for (name, err), g, rg in zip(errs.items(), [out, *grads], [ref_out, *ref_grads]):
        assert g.shape == rg.shape and g.dtype == q.dtype, name
        assert err < TOL[dtype], (name, err)
    return errs


KERNELS = {"xla": XLA_KERNEL, "blockwise": BLOCKWISE_KERNEL, "pallas": PALLAS_INTERPRET_KERNEL}
# ring x heads x (causal, segment ids), with dtype, token order and local kernel rotating over the cases (the
# kernel as a Latin square: each kernel meets every ring size, head layout and mask setting)
MATRIX = [
    (ring, heads, causal, use_seg, ["float32", "bfloat16"][i % 2], ["zigzag", "contiguous"][i // 2 % 2],
     list(KERNELS)[(i + i // 3 + i // 9) % 3])
    for i, (ring, heads, (causal, use_seg)) in enumerate(
        itertools.product([2, 4, 8], HEADS, [(True, True), (True, False), (False, True)])
    )
]


def case_id(c):
    ring, heads, causal, use_seg, dtype, order, kernel = c
    return (f"ring{ring}-{heads}-{'causal' if causal else 'full'}-{'seg' if use_seg else 'noseg'}-{dtype}-{order}"
            f"-{kernel}")


def test_matrix_gives_every_kernel_every_ring_layout_and_mask():
    for kernel in KERNELS:
        cases = [c for c in MATRIX if c[-1] == kernel]
        assert {c[0] for c in cases} == {2, 4, 8} and {c[1] for c in cases} == set(HEADS)
        assert {c[2:4] for c in cases} == {(True, True), (True, False), (False, True)}


# The default suite keeps one case per kernel (ring sizes, head layouts, masks, dtypes and orders spread over the
# three); the rest of the Latin square runs in `make test-slow`.
DEFAULT = {
    "ring8-gqa-causal-seg-bfloat16-zigzag-xla",
    "ring4-gqa-full-seg-float32-contiguous-blockwise",
    "ring2-mqa-causal-seg-float32-contiguous-pallas",
}


def test_default_cases_exist():
    assert DEFAULT <= {case_id(c) for c in MATRIX}


@pytest.mark.parametrize("case", [c if case_id(c) in DEFAULT else pytest.param(c, marks=pytest.mark.slow)
                                  for c in MATRIX], ids=case_id)
def test_ring_matches_reference(case, seed):
    ring, heads, causal, use_seg, dtype, order, kernel = case
    h, hkv = HEADS[heads]
    # no document boundary on a chunk boundary: documents cross the boundaries between ranks
    q, k, v, do, seg = random_inputs(seed, B, S, h, hkv, D, jnp.dtype(dtype), shard=S // (2 * ring))
    if use_seg:  # some document spans several ranks
        ranks = rank_of_token(order, ring)
        assert any(len(set(ranks[np.asarray(seg)[b] == i])) > 1 for b in range(B) for i in range(3))

    def fn(q, k, v, s=None):
        return ring_attention(q, k, v, axis_name="ring", causal=causal, segment_ids=s, order=order,
                              kernel=KERNELS[kernel])

    # Pallas calls carry no varying-manual-axes annotations
    attend = sequence_parallel(fn, ring_mesh(ring), order, ring, use_seg, seg, check_vma=kernel != "pallas")
    check_against_reference(attend, q, k, v, do, seg if use_seg else None, causal, dtype)


@pytest.mark.parametrize(
    "h, hkv, dtype", [(8, 2, "float32"), (12, 4, "bfloat16")], ids=["gqa-kv-copied-f32", "h12-padded-bf16"]
)
def test_ulysses_ring_2d_matches_reference(h, hkv, dtype, seed):
    """ring=2 x sp=4: the Ulysses all-to-alls inside each sp group, the ring across; zigzag order."""
    ring, sp = 2, 4
    q, k, v, do, seg = random_inputs(seed, B, S, h, hkv, D, jnp.dtype(dtype), shard=S // (2 * ring * sp))
    layout = plan_heads(h, hkv, sp)

    def fn(q, k, v, s):
        return ulysses_ring_local(q, k, v, s, sp_axis="sp", ring_axis="ring", layout=layout, order="zigzag")

    attend = sequence_parallel(fn, ring_mesh(ring, sp), "zigzag", ring, True, seg)
    check_against_reference(attend, q, k, v, do, seg, True, dtype)


def test_zigzag_order():
    # 4 ranks, 8 chunks of 2 tokens: rank r holds chunks r and 7 - r
    assert zigzag_order(16, 4).tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    for s, r in [(16, 4), (64, 8), (4096, 4)]:
        perm, inv = zigzag_order(s, r), zigzag_inverse(s, r)
        assert sorted(perm.tolist()) == list(range(s))
        assert (perm[inv] == np.arange(s)).all() and (inv[perm] == np.arange(s)).all()
    with pytest.raises(ValueError, match=r"sequence length \(30\) must be divisible by 2 \* ring \(8\)"):
        zigzag_order(30, 4)


@pytest.mark.parametrize("ring", [2, 4, 8])
def test_zigzag_balances_causal_work(ring):
    """Zigzag: every rank computes the same blocks and sees the same number of visible (q, k) pairs; a plain
    split gives rank r r + 1 blocks. And the schedule is exact: SKIP blocks hold no visible pair, FULL blocks
    only visible pairs, and every visible pair is in a computed block."""
    seq = 128 * ring
    s, c = seq // ring, seq // (2 * ring)
    assert ring_work(seq, ring, order="zigzag").tolist() == [(2 * ring + 1) * c * c] * ring
    assert ring_work(seq, ring, order="contiguous").tolist() == [(r + 1) * s * s for r in range(ring)]
    assert ring_work(seq, ring, order="zigzag", causal=False).tolist() == [s * seq] * ring
    for order in ("zigzag", "contiguous"):
        pos = sequence_order(order, seq, ring).reshape(ring, s)
        visible = [int((pos[r][:, None] >= pos.reshape(-1)[None, :]).sum()) for r in range(ring)]
        if order == "zigzag":
            assert visible == [visible[0]] * ring == [(2 * ring - 1) * c * c + c * (c + 1)] * ring
        else:
            assert visible == [r * s * s + s * (s + 1) // 2 for r in range(ring)]
        kinds = ring_schedule(order, seq, ring, True)
        n = kinds.shape[-1]
        chunks = pos.reshape(ring, n, -1)
        for r, src, i, j in itertools.product(range(ring), range(ring), range(n), range(n)):
            mask = chunks[r, i][:, None] >= chunks[src, j][None, :]
            assert kinds[r, src, i, j] == (SKIP if not mask.any() else FULL if mask.all() else DIAG)


def test_skipped_blocks_do_not_run(seed):
    """Count the kernel's executions per rank at run time (a callback inside each branch): the switch
    runs only this rank's kind, and the counts equal the static schedule (zigzag: 2R + 1 per rank)."""
    ring = 4
    calls = collections.Counter()

    def forward(q, k, v, q_pos, k_pos, q_seg, k_seg, *, causal, scale):
        jax.debug.callback(lambda r: calls.update([(int(r), causal)]), jax.lax.axis_index("ring"))
        return xla_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, causal=causal, scale=scale)

    counting = LocalKernel(forward, XLA_KERNEL.backward)
    q, k, v, _, _ = random_inputs(seed, B, S, 4, 2, D, jnp.float32)
    mesh = ring_mesh(ring)
    fn = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="ring", kernel=counting), mesh=mesh,
                       in_specs=(P(None, "ring"),) * 3, out_specs=P(None, "ring"))
    perm = zigzag_order(S, ring)
    out = run_jitted(fn, q[:, perm], k[:, perm], v[:, perm])[:, zigzag_inverse(S, ring)]
    jax.effects_barrier()
    assert rel_err(out, attention_f64(q, k, v)) < TOL["float32"]
    assert calls == {(r, True): 2 for r in range(ring)} | {(r, False): 2 * ring - 1 for r in range(ring)}


def permutes(hlo_text, ring):
    """``sorted [(bytes of the result on one device, shift)]`` of every collective-permute in the HLO, where
    ``shift`` is how far along the ring it sends (+1: to the next rank, -1: to the previous one)."""
    found = []
    comps, _ = parse(hlo_text)
    for ins in itertools.chain(*comps.values()):
        assert ins.opcode.removesuffix("-start") not in ("all-gather", "all-reduce", "all-to-all", "reduce-scatter")
        if ins.opcode == "collective-permute":
            pairs = re.findall(r"\{(\d+),(\d+)\}", ins.attrs.split("source_target_pairs=")[1])
            (shift,) = {(int(dst) - int(src)) % ring for src, dst in pairs}
            found.append((array_bytes(ins.type), shift if shift <= ring // 2 else shift - ring))
    return sorted(found)


def test_hlo_collective_permutes_with_formula_bytes(seed):
    """Forward: R - 1 permutes of [K; V] (K and V stacked: one permute per step) and R - 1 of the segment
    ids, to the next rank. Forward + backward: the backward runs the ring the other way (so XLA cannot
    merge its rotations with the forward's and keep all R blocks): R - 1 permutes of [K; V] and of the ids
    and R of [dK; dV] in float32, to the previous rank. Nothing else crosses devices (float32 here: XLA:CPU
    carries bfloat16 permutes as float32; the GPU test below checks bfloat16)."""
    ring, (h, hkv) = 4, HEADS["gqa"]
    q, k, v, do, seg = random_inputs(seed, B, S, h, hkv, D, jnp.float32)
    mesh, spec = ring_mesh(ring), P(None, "ring")
    fn = jax.shard_map(lambda q, k, v, s: ring_attention(q, k, v, axis_name="ring", segment_ids=s), mesh=mesh,
                       in_specs=(spec,) * 4, out_specs=spec)
    want = ring_permute_bytes(batch=B, tokens=S // ring, kv_heads=hkv, head_dim=D, itemsize=4, ring=ring,
                              segment_ids=True)
    kv = 2 * B * (S // ring) * hkv * D * 4  # [K; V]: 2 x 2 rows x 16 tokens x 2 KV heads x 16 x float32
    assert want == {"forward_kv": (3, kv), "backward_kv": (3, kv), "backward_dkv": (4, kv),
                    "forward_segment_ids": (3, 4 * B * 16), "backward_segment_ids": (3, 4 * B * 16)}

    def expected(**shifts):
        return sorted(itertools.chain(*([(want[name][1], shift)] * want[name][0] for name, shift in shifts.items())))

    fwd = permutes(jax.jit(fn).lower(q, k, v, seg).compile(FAST_COMPILE).as_text(), ring)
    assert fwd == expected(forward_kv=1, forward_segment_ids=1)

    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, seg) * do), argnums=(0, 1, 2)))
    both = permutes(grad.lower(q, k, v).compile(FAST_COMPILE).as_text(), ring)
    assert both == expected(forward_kv=1, forward_segment_ids=1, backward_kv=-1, backward_segment_ids=-1,
                            backward_dkv=-1)


@pytest.mark.aot
def test_h100_program_permutes_bf16_async_overlapped():
    """The same on 4 compile-only H100s, one per host (the ring crosses the network), bfloat16: the bytes of
    the formula (XLA:GPU may fuse a step's permutes into one tuple: bytes, not op counts, are compared), all
    asynchronous, and every forward permute has the attention of a step scheduled between start and done."""
    from ulysses_jax.plan.hlo import collectives
    from ulysses_jax.plan.targets import target_devices

    ring, b, s, h, hkv, d = 4, 1, 512, 8, 2, 64
    mesh = jax.make_mesh((ring,), ("ring",), axis_types=(AxisType.Auto,), devices=target_devices("h100", devices=ring,
                                                                                                   hosts=ring))
    spec = P(None, "ring")
    shard = jax.sharding.NamedSharding(mesh, spec)
    qs = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16, sharding=shard)
    kvs = jax.ShapeDtypeStruct((b, s, hkv, d), jnp.bfloat16, sharding=shard)
    segs = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=shard)
    fn = jax.shard_map(lambda q, k, v, sg: ring_attention(q, k, v, axis_name="ring", segment_ids=sg), mesh=mesh,
                       in_specs=(spec,) * 4, out_specs=spec)
    want = ring_permute_bytes(batch=b, tokens=s // ring, kv_heads=hkv, head_dim=d, itemsize=2, ring=ring,
                              segment_ids=True)

    def total(*names):
        return sum(want[n][0] * want[n][1] for n in names)

    fwd = collectives(jax.jit(fn).trace(qs, kvs, kvs, segs).lower().compile(FAST_COMPILE).as_text(), devices_per_host=1,
                      num_devices=ring)
    assert set(fwd) == {"collective-permute"}
    cp = fwd["collective-permute"]
    assert cp.bytes == cp.inter_host_bytes == total("forward_kv", "forward_segment_ids")
    assert cp.async_pairs == cp.overlapped == cp.count >= ring - 1

    grad = jax.jit(jax.grad(lambda q, k, v, sg: jnp.sum(fn(q, k, v, sg).astype(jnp.float32)), argnums=(0, 1, 2)))
    both = collectives(grad.trace(qs, kvs, kvs, segs).lower().compile(FAST_COMPILE).as_text(), devices_per_host=1,
                       num_devices=ring)
    cp = both["collective-permute"]
    assert set(both) == {"collective-permute"} and cp.async_pairs == cp.count
    assert cp.bytes == total("forward_kv", "forward_segment_ids", "backward_kv", "backward_segment_ids", "backward_dkv")
    assert cp.overlapped >= cp.count - 1  # all but the last hop home of dK/dV, after the last step


def test_invalid_arguments():
    mesh, spec = ring_mesh(4), P(None, "ring")
    x = jnp.ones((1, 12, 2, 4))  # 3 local tokens
    cases = [("striped", r"unknown order 'striped'"), ("zigzag", r"local sequence length \(3\) must be even")]
    for order, match in cases:
        fn = jax.shard_map(lambda q: ring_attention(q, q, q, axis_name="ring", order=order), mesh=mesh,  # noqa: B023
                           in_specs=spec, out_specs=spec)
        with pytest.raises(ValueError, match=match):
            fn(x)
