"""Ring attention with a sliding window: exact against the float64 reference in both token orders and with every
local kernel, whole ring steps outside every window skipped (no compute, no permute), counted against the schedule."""

import collections
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from np_reference import TOL, attention_f64, random_inputs, rel_err
from test_ring import FAST_COMPILE, KERNELS, permutes, ring_mesh, run_jitted, sequence_parallel

from ulysses_jax.parallel.ring import (
    SKIP,
    XLA_KERNEL,
    LocalKernel,
    active_steps,
    ring_attention,
    ring_permute_bytes,
    ring_schedule,
    ring_work,
    sequence_order,
    xla_forward,
    zigzag_inverse,
    zigzag_order,
)

B, S, D = 2, 64, 16
# ring x order x window (chunk = S / 2R: windows below, at and above a chunk; 40 reaches over several ranks), the
# kernel rotating over the cases
CASES = [(ring, order, window, list(KERNELS)[i % 3])
         for i, (ring, order, window) in enumerate(itertools.product([4], ["zigzag", "contiguous"], [5, 8, 40]))]
CASES += [(2, "zigzag", 20, "pallas"), (8, "contiguous", 3, "blockwise")]


# the default suite keeps every kernel, both orders and rings of 2, 4 and 8; `make test-slow` the other windows
DEFAULT = {(4, "zigzag", 5, "xla"), (4, "contiguous", 8, "blockwise"), (2, "zigzag", 20, "pallas"),
           (8, "contiguous", 3, "blockwise")}


def test_default_cases_exist():
    assert DEFAULT <= set(CASES)


@pytest.mark.parametrize("case", [c if c in DEFAULT else pytest.param(c, marks=pytest.mark.slow) for c in CASES],
                         ids=lambda c: "-".join(map(str, c)))
def test_windowed_ring_matches_float64(case, seed):
    ring, order, window, kernel = case
    q, k, v, do, seg = random_inputs(seed, B, S, 4, 2, D, jnp.float32, shard=S // (2 * ring))

    def fn(q, k, v, s):
        return ring_attention(q, k, v, axis_name="ring", segment_ids=s, order=order, kernel=KERNELS[kernel],
                              window=window)

    attend = sequence_parallel(fn, ring_mesh(ring), order, ring, True, seg, check_vma=kernel != "pallas")

    def loss(q, k, v):
        out = attend(q, k, v)
        return jnp.sum(out * do), out

    (_, out), grads = run_jitted(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), q, k, v)
    ref_out, ref_grads = attention_f64(q, k, v, do, causal=True, segment_ids=seg, window=window)
    for name, x, w in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        assert rel_err(x, w) < TOL["float32"], (name, rel_err(x, w))


@pytest.mark.parametrize("order", ["zigzag", "contiguous"])
@pytest.mark.parametrize("window", [1, 5, 8, 17, 40, 64])
def test_schedule_is_exact_with_a_window(order, window):
    """SKIP pairs hold no allowed (query, key) pair, FULL pairs only allowed ones; the work shrinks with the window."""
    ring, seq = 4, 64
    kinds = ring_schedule(order, seq, ring, True, window)
    n = kinds.shape[-1]
    chunks = sequence_order(order, seq, ring).reshape(ring, n, -1)
    for r, src, i, j in itertools.product(range(ring), range(ring), range(n), range(n)):
        dq = chunks[r, i][:, None] - chunks[src, j][None, :]
        mask = (dq >= 0) & (dq < window)
        assert (kinds[r, src, i, j] == SKIP) == (not mask.any())
        if kinds[r, src, i, j] == 1:
            assert mask.all()
    assert (ring_work(seq, ring, order=order, window=window) <= ring_work(seq, ring, order=order)).all()


def test_active_steps():
    """Contiguous: a window within a rank's block needs only its own block and the previous rank's. Zigzag: rank
    r's second chunk borders rank r + 1's, which arrives at the last forward step."""
    assert active_steps(ring_schedule("contiguous", 64, 8, True, 3), 1) == [0, 1]
    assert active_steps(ring_schedule("contiguous", 64, 8, True, 3), -1) == [0, 7]
    assert active_steps(ring_schedule("zigzag", 64, 4, True, 5), 1) == [0, 1, 3]
    assert active_steps(ring_schedule("zigzag", 64, 4, True, None), 1) == [0, 1, 2, 3]
    assert active_steps(ring_schedule("contiguous", 64, 8, True, 64), 1) == list(range(8))


def test_skipped_steps_do_not_run_nor_travel(seed):
    """Contiguous order, R = 8, window 3 (< a rank's 8 tokens): each rank computes its own block and its
    predecessor's, nothing else (a callback inside each kernel branch counts); one forward permute of [K; V]
    instead of 7; backward two of [dK; dV] (one step, one hop home) instead of 8."""
    ring, window = 8, 3
    calls = collections.Counter()

    def forward(q, k, v, q_pos, k_pos, q_seg, k_seg, **kw):
        jax.debug.callback(lambda r: calls.update([int(r)]), jax.lax.axis_index("ring"))
        return xla_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, **kw)

    counting = LocalKernel(forward, XLA_KERNEL.backward)
    q, k, v, do, _ = random_inputs(seed, B, S, 4, 2, D, jnp.float32)
    mesh, spec = ring_mesh(ring), P(None, "ring")

    def run(kernel):
        return jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="ring", order="contiguous",
                                                            kernel=kernel, window=window),
                             mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)

    out = run_jitted(run(counting), q, k, v)
    jax.effects_barrier()
    assert rel_err(out, attention_f64(q, k, v, window=window)) < TOL["float32"]
    assert calls == {0: 1} | {r: 2 for r in range(1, ring)}  # rank 0 has no predecessor in the window

    fwd = permutes(jax.jit(run(XLA_KERNEL)).lower(q, k, v).compile(FAST_COMPILE).as_text(), ring)
    kv = 2 * B * (S // ring) * 2 * D * 4
    assert fwd == [(kv, 1)]
    want = ring_permute_bytes(batch=B, tokens=S // ring, kv_heads=2, head_dim=D, itemsize=4, ring=ring,
                              segment_ids=False, steps=(2, True))
    assert want == {"forward_kv": (1, kv), "backward_kv": (1, kv), "backward_dkv": (2, kv)}
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(run(XLA_KERNEL)(q, k, v) * do), argnums=(0, 1, 2)))
    both = permutes(grad.lower(q, k, v).compile(FAST_COMPILE).as_text(), ring)
    # the backward's one hop of [K; V] is the shift the forward made (its steps 0 and 7 = -1): XLA reuses the
    # forward's permute; then dK/dV follow the block (+1) and go home (-1)
    assert both == sorted([(kv, 1), (kv, 1), (kv, -1)])


def test_zigzag_window_jumps_over_middle_steps(seed):
    """Zigzag, R = 4, window 5: steps 0, 1 and 3 run; the block jumps from step 1 to 3 in one permute of shift 2."""
    ring, window = 4, 5
    q, k, v, _, _ = random_inputs(seed, B, S, 4, 2, D, jnp.float32)
    mesh, spec = ring_mesh(ring), P(None, "ring")
    fn = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="ring", window=window), mesh=mesh,
                       in_specs=(spec,) * 3, out_specs=spec)
    perm = zigzag_order(S, ring)
    compiled = jax.jit(fn).lower(q[:, perm], k[:, perm], v[:, perm]).compile(FAST_COMPILE)
    kv = 2 * B * (S // ring) * 2 * D * 4
    assert permutes(compiled.as_text(), ring) == sorted([(kv, 1), (kv, 2)])
    out = compiled(q[:, perm], k[:, perm], v[:, perm])[:, zigzag_inverse(S, ring)]
    assert rel_err(out, attention_f64(q, k, v, window=window)) < TOL["float32"]
    assert np.array_equal(np.sort(perm), np.arange(S))
