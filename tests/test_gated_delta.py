"""The gated delta rule: chunked form against the token-by-token recurrence (float64, outputs and gradients), packed
documents against each document alone, the causal convolution's reset, low precision, jit, and transformers.

Every gradient check runs through one jitted function per (form, dtype) at one shape, ``[2, 200]`` (S = 200 with
chunks of 64: three full chunks and a padded one), to keep compilation, the bulk of the time on a CPU, to a few.
Inputs are random, gates as the layer computes them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ulysses_jax.kernels.gated_delta import document_index, gated_delta_flops, gated_delta_rule, gates
from ulysses_jax.kernels.gated_delta_reference import gated_delta_recurrent
from ulysses_jax.kernels.short_conv import causal_conv1d

B, S, HK, HV, DK, DV = 2, 200, 2, 4, 16, 32
# two blocks of two chunks of 64 at S = 200 (the default block, 64 chunks, would hold all four)
blocked = functools.partial(gated_delta_rule, block=2)
rule = jax.jit(gated_delta_rule, static_argnames=("chunk", "block", "use_qk_l2norm"))
recurrent = jax.jit(gated_delta_recurrent, static_argnames=("use_qk_l2norm",))


@pytest.fixture
def x64():
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


def inputs(seed, b=B, s=S, hk=HK, hv=HV, dk=DK, dv=DV, dtype=np.float64):
    """Random q, k, v and gates as the layer makes them (g from A_log, a, dt_bias; beta = sigmoid(b))."""
    r = np.random.default_rng(seed)
    q, k = (r.normal(size=(b, s, hk, dk)) for _ in range(2))
    v = r.normal(size=(b, s, hv, dv))
    # A in [0.01, 16] as the layer initialises it: per-token decays exp(g) from about 0.99 to far below 1e-3
    g, beta = gates(jnp.asarray(r.normal(size=(b, s, hv))), jnp.asarray(r.normal(size=(b, s, hv))),
                    jnp.log(jnp.asarray(r.uniform(0.01, 16, size=hv))), jnp.asarray(r.normal(size=hv)))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v, g, beta))


@functools.partial(jax.jit, static_argnames=("fn",))
def _run(fn, args, seg, cotangent):
    o, vjp = jax.vjp(lambda *a: fn(*a, segment_ids=seg), *args)
    return o, vjp(cotangent.astype(o.dtype))


def run(fn, args, seg, cotangent):
    """``fn``'s output and the gradients in q, k, v, g, beta of ``sum(output * cotangent)``, as numpy arrays."""
    return jax.tree.map(np.asarray, _run(fn, args, seg, cotangent))


def cotangent(seed=99):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, S, HV, DV)))


def close(a, b, rtol, atol_frac):
    """``|a - b| <= rtol |b| + atol_frac max|b|`` elementwise."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol_frac * np.abs(b).max())


def test_chunked_equals_recurrence_in_float64(x64):
    """Three documents and padding per row: a boundary mid-chunk, one at a chunk and block start, a chunk holding two,
    a document across the two blocks."""
    args = inputs(0)
    seg = jnp.asarray([[1] * 70 + [2] * 58 + [3] * 50 + [0] * 22, [4] * 30 + [5] * 20 + [6] * 150])
    (o, d), (o_ref, d_ref) = run(blocked, args, seg, cotangent()), run(gated_delta_recurrent, args, seg, cotangent())
    assert o.shape == (B, S, HV, DV) and o.dtype == jnp.float64
    close(o, o_ref, 1e-10, 1e-12)
    for x, y, a in zip(d, d_ref, args):
        assert x.shape == y.shape == a.shape
        close(x, y, 1e-9, 1e-11)


@pytest.mark.parametrize("chunk, block", [(1, 64), (16, 64), (256, 64), (7, 2)])
def test_any_chunk_and_block_size(x64, chunk, block):
    """S = 37: one token a chunk, chunks smaller than a document, one chunk longer than the whole sequence, three
    blocks of two chunks of 7 (42 tokens, 5 of padding). No segment ids."""
    args = inputs(1, s=37)
    close(rule(*args, chunk=chunk, block=block), recurrent(*args), 1e-10, 1e-12)


def test_packed_documents_equal_each_alone(x64):
    """Two documents packed in a row, in both orders (boundaries at 70 and 130, inside chunks of 64), give each
    document's outputs and gradients alone: a batch of the two documents from position 0, each followed by tokens
    that change nothing (zeros, g = beta = 0) and one segment id for the whole row (a single document)."""
    first, second = (tuple(map(np.asarray, inputs(seed))) for seed in (2, 3))
    la, lb = 70, 130  # document a: row 0 of `first`, document b: row 0 of `second`
    packed = tuple(np.stack([np.concatenate([a[0, :la], b[0, :lb]]), np.concatenate([b[0, :lb], a[0, :la]])])
                   for a, b in zip(first, second))

    def lone(x, n):  # the first n tokens of row 0, then S - n tokens of zeros
        return np.pad(x[0, :n], [(0, S - n)] + [(0, 0)] * (x.ndim - 2))

    alone = tuple(np.stack([lone(a, la), lone(b, lb)]) for a, b in zip(first, second))
    ct = np.array(cotangent())  # the packed rows' weights; the lone documents get the same weight per token
    ct_alone = np.stack([lone(ct, la), lone(ct[:, la:], lb)])
    ct[1] = np.concatenate([ct[0, la:], ct[0, :la]])
    ids = np.asarray([[1] * la + [2] * lb, [1] * lb + [2] * la])
    o_p, d_p = run(blocked, packed, ids, ct)
    o_a, d_a = run(blocked, alone, np.ones((B, S), int), ct_alone)
    for row, spans in enumerate([((0, la, 0), (la, lb, 1)), ((0, lb, 1), (lb, la, 0))]):
        for start, n, doc in spans:
            close(o_p[row, start:start + n], o_a[doc, :n], 1e-12, 1e-13)
            for x, y in zip(d_p, d_a):
                close(x[row, start:start + n], y[doc, :n], 1e-10, 1e-12)
    # two runs of one id are two documents
    np.testing.assert_array_equal(document_index(jnp.asarray([[5, 5, 2, 5, 0, 0]]), 1, 6), [[0, 0, 1, 2, 3, 3]])


def conv_loop(x, w, seg, silu=True):
    """``out[t] = silu(sum_i w[:, i] x[t - K + 1 + i])`` over taps in t's own document, one token at a time."""
    b, s, c = x.shape
    out = np.zeros_like(x)
    for r in range(b):
        for t in range(s):
            for i in range(w.shape[1]):
                src = t - w.shape[1] + 1 + i
                if src >= 0 and all(seg[r, src:t + 1] == seg[r, t]):
                    out[r, t] += w[:, i] * x[r, src]
    return out / (1 + np.exp(-out)) if silu else out


def test_causal_conv1d_resets_at_documents(x64):
    r = np.random.default_rng(3)
    x, w = r.normal(size=(2, 19, 6)), r.normal(size=(6, 4))
    seg = np.array([[1] * 5 + [2] * 2 + [3] * 9 + [0] * 3, [4] * 1 + [7] * 18])
    close(causal_conv1d(jnp.asarray(x), jnp.asarray(w), jnp.asarray(seg)), conv_loop(x, w, seg), 1e-12, 1e-14)
    close(causal_conv1d(jnp.asarray(x), jnp.asarray(w)), conv_loop(x, w, np.ones((2, 19), int)), 1e-12, 1e-14)
    short = causal_conv1d(jnp.asarray(x[:, :2]), jnp.asarray(w), activation=None)  # fewer tokens than taps
    close(short, conv_loop(x[:, :2], w, np.ones((2, 2), int), silu=False), 1e-12, 1e-14)


@pytest.mark.parametrize("s,silu", [(11, True), (11, False), (2, True)], ids=["silu", "no-activation", "short"])
def test_causal_conv1d_gradients_of_its_own_backward(x64, s, silu):
    """The convolution's backward is its own (the taps run again from x, the pre-activation's gradient transposed
    through them): the gradients of x and w equal the float64 central differences of the token-by-token loop's sum
    against a random cotangent, with documents, without the SiLU, and with fewer tokens than taps."""
    r = np.random.default_rng(4)
    x, w, ct = r.normal(size=(2, s, 3)), r.normal(size=(3, 4)), r.normal(size=(2, s, 3))
    seg = np.array([[1] * 4 + [2] * 7, [3] * 6 + [0] * 5])[:, :s]
    act = "silu" if silu else None

    def ours(x, w):
        return jnp.sum(causal_conv1d(x, w, jnp.asarray(seg), activation=act) * ct)

    def loop(x, w):
        return float(np.sum(conv_loop(x, w, seg, silu=silu) * ct))

    dx, dw = jax.grad(ours, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    eps = 1e-6
    for arr, grad, which in ((x, dx, 0), (w, dw, 1)):
        want = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            up, down = arr.copy(), arr.copy()
            up[idx] += eps
            down[idx] -= eps
            args_up, args_down = ((up, w), (down, w)) if which == 0 else ((x, up), (x, down))
            want[idx] = (loop(*args_up) - loop(*args_down)) / (2 * eps)
        close(grad, want, 1e-7, 1e-8)


def test_causal_conv1d_backward_in_bf16_is_within_rounding_of_float32():
    """bf16 inputs: the backward holds the pre-activation's gradient in bf16 (``_conv_bwd``); its gradients are within
    bf16 rounding of the float32 computation on the same (bf16-rounded) inputs. (What it saves in memory is read
    from the compiled H100 step: experiments/results/plan_hybrid_h100.md.)"""
    r = np.random.default_rng(5)
    b, s, c = 1, 4096, 64
    x, w, ct = (jnp.asarray(r.normal(size=shape), jnp.float32) for shape in ((b, s, c), (c, 4), (b, s, c)))
    seg = jnp.asarray(np.repeat(np.arange(4), s // 4)[None])

    def grads(x, w, ct):
        return jax.grad(lambda x, w: jnp.sum(causal_conv1d(x, w, seg).astype(jnp.float32) * ct), argnums=(0, 1))(x, w)

    g16 = jax.jit(grads)(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), ct.astype(jnp.bfloat16))
    g32 = jax.jit(grads)(*(a.astype(jnp.bfloat16).astype(jnp.float32) for a in (x, w, ct)))
    for got, want in zip(g16, g32):
        got, want = np.asarray(got, np.float32), np.asarray(want)
        assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()


def test_low_precision_inputs():
    """bf16 inputs: float32 inside, output and gradients in bf16, near the float32 recurrence on the same values (the
    output's own rounding, 2^-8 relative, dominates). float32 inputs: test_under_jit_segment_ids_are_data."""
    args32 = tuple(x.astype(jnp.bfloat16).astype(jnp.float32) for x in inputs(4, dtype=np.float32))
    seg = jnp.asarray([[1] * 120 + [2] * 80, [3] * 200])
    o_ref, d_ref = run(gated_delta_recurrent, args32, seg, cotangent())
    o, d = run(gated_delta_rule, tuple(x.astype(jnp.bfloat16) for x in args32), seg, cotangent())
    assert o.dtype == jnp.bfloat16 and all(x.dtype == jnp.bfloat16 for x in d)
    close(o, o_ref, 1e-2, 1e-2)
    for x, y in zip(d, d_ref):
        close(x, y, 1e-2, 2e-2)


def test_bf16_products_stay_near_the_float32_recurrence():
    """``precision="bf16"`` (the chunk products on bf16 operands, float32 results; the state and the triangular
    inverse float32): float32 inputs, output and gradients near the float32 recurrence, within bf16 rounding of the
    products; its program holds bf16 products (not a no-op); an unknown precision is refused."""
    args = inputs(6, dtype=np.float32)
    seg = jnp.asarray([[1] * 120 + [2] * 80, [3] * 200])
    low = functools.partial(gated_delta_rule, precision="bf16")
    o_ref, d_ref = run(gated_delta_recurrent, args, seg, cotangent())
    o, d = run(low, args, seg, cotangent())
    o_hi, _ = run(gated_delta_rule, args, seg, cotangent())
    close(o, o_ref, 1e-2, 1.5e-2)  # measured: 0.6% of the output's largest value at most, 0.3-0.6% for the gradients
    for x, y in zip(d, d_ref):
        close(x, y, 1e-2, 1.5e-2)
    assert np.abs(o - o_ref).max() > 100 * np.abs(o_hi - o_ref).max()  # the products are really bf16
    jaxpr = str(jax.make_jaxpr(lambda *a: low(*a, segment_ids=seg))(*args))
    assert "bf16" in jaxpr and "preferred_element_type=float32" in jaxpr
    with pytest.raises(ValueError, match=r"precision 'tf32' is not one of 'highest', 'bf16'"):
        gated_delta_rule(*args, precision="tf32")


def test_under_jit_segment_ids_are_data():
    """Jitted, other segment ids (another packing) reuse the one compilation; both runs match the float32 recurrence
    to 1e-4 relative (float32 inputs)."""
    args = inputs(5, s=40, dtype=np.float32)
    fn = jax.jit(functools.partial(gated_delta_rule, chunk=16))
    for ids in ([[1] * 25 + [2] * 15] * B, [[1] * 7 + [2] * 30 + [0] * 3] * B):
        close(fn(*args, segment_ids=jnp.asarray(ids)), recurrent(*args, segment_ids=jnp.asarray(ids)), 1e-4, 1e-5)
    assert fn._cache_size() == 1


def test_flops_and_contract():
    per_token = 4 * 64 * 128 + 2 * 64 * 64 // 3 + 2 * 64 * 256 + 2 * 64 * 128 + 6 * 128 * 128  # about 183k
    assert gated_delta_flops(128, 128, 128) == 128 * per_token
    assert gated_delta_flops(100, 128, 128) == gated_delta_flops(128, 128, 128)  # padded to the chunk
    assert 3.8 < gated_delta_flops(64, 128, 128, backward=True) / gated_delta_flops(64, 128, 128) < 4
    q, k, v, g, beta = inputs(6, s=8, dtype=np.float32)
    with pytest.raises(ValueError, match="multiple of the 2 key heads"):
        gated_delta_rule(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
    with pytest.raises(ValueError, match="chunk"):
        gated_delta_rule(q, k, v, g, beta, chunk=0)


def test_matches_transformers(x64):
    """transformers' torch recurrence and chunked form (float32 inside, use_qk_l2norm_in_kernel=True), the gates
    and the convolution, on the same random inputs: within 2e-5 of the largest output."""
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    r = np.random.default_rng(7)
    a_in, b_in = r.normal(size=(B, S, HV)), r.normal(size=(B, S, HV))
    a_log, dt_bias = np.log(r.uniform(0.01, 16, size=HV)), r.normal(size=HV)
    g, beta = gates(*(jnp.asarray(x) for x in (a_in, b_in, a_log, dt_bias)))
    t = torch.from_numpy
    g_hf = -t(a_log).exp() * torch.nn.functional.softplus(t(a_in) + t(dt_bias))
    close(g, g_hf.numpy(), 1e-12, 0)
    close(beta, t(b_in).sigmoid().numpy(), 1e-12, 0)
    q, k, v = r.normal(size=(B, S, HK, DK)), r.normal(size=(B, S, HK, DK)), r.normal(size=(B, S, HV, DV))
    args, one_document = tuple(jnp.asarray(x) for x in (q, k, v, g, beta)), jnp.ones((B, S), int)
    ours = run(blocked, args, one_document, cotangent())[0]  # compiled once for the float64 test
    close(run(gated_delta_recurrent, args, one_document, cotangent())[0], ours, 1e-10, 1e-12)
    theirs = {fn.__name__: fn(t(q), t(k), t(v), g=t(np.asarray(g)), beta=t(np.asarray(beta)),
                              use_qk_l2norm_in_kernel=True)[0].double().numpy()
              for fn in (hf.torch_recurrent_gated_delta_rule, hf.torch_chunk_gated_delta_rule)}
    for out in theirs.values():
        close(out, ours, 0, 2e-5)
    x, w = r.normal(size=(B, 11, 6)), r.normal(size=(6, 4))
    conv_hf = hf.torch_causal_conv1d_fn if hasattr(hf, "torch_causal_conv1d_fn") else hf.causal_conv1d_fn
    close(causal_conv1d(jnp.asarray(x), jnp.asarray(w)),
          conv_hf(t(x).transpose(1, 2), t(w), activation="silu").transpose(1, 2).numpy(), 1e-12, 1e-14)
