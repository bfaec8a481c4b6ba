"""Attention sinks (gpt-oss) in every attention path, against a float64 NumPy reference with its own backward:
outputs and the gradients of q, k, v and the sinks, with windows, packed documents and GQA; ``sinks=None`` unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from np_reference import random_inputs, rel_err

from ulysses_jax import attention, make_mesh, ulysses_attention
from ulysses_jax.kernels.attention import auto_reason, resolve_impl

TOL = 2e-5  # float32 against float64 (rel_err: max-abs error over max-abs reference)


def attention_sinks_f64(q, k, v, sinks, dout, *, causal=True, segment_ids=None, scale=None, window=None):
    """q [B,S,H,D], k/v [B,S,Hkv,D], sinks [H] -> out and (dq, dk, dv, dsinks), float64. The sink is one more logit
    per row (in the units of the scaled scores) whose value vector is zero."""
    q, k, v, sinks, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, sinks, dout))
    b, s, h, d = q.shape
    g = h // k.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    kh, vh = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    pos = np.arange(s)
    mask = np.ones((b, 1, s, s), dtype=bool)
    if causal:
        mask &= (pos[:, None] >= pos[None, :])[None, None]
    if window is not None:
        mask &= (pos[:, None] - pos[None, :] < window)[None, None]
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        mask &= (seg[:, :, None] == seg[:, None, :])[:, None]
    logits = np.where(mask, np.einsum("bqhd,bkhd->bhqk", q, kh) * scale, -np.inf)
    sink = np.broadcast_to(sinks[None, :, None, None], (b, h, s, 1))
    full = np.concatenate([logits, sink], axis=-1)
    e = np.exp(full - full.max(axis=-1, keepdims=True))
    pfull = e / e.sum(axis=-1, keepdims=True)
    p, p_sink = pfull[..., :-1], pfull[..., -1]
    out = np.einsum("bhqk,bkhd->bqhd", p, vh)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vh)
    delta = (dp * p).sum(axis=-1, keepdims=True)  # the sink's value is zero: it adds nothing here
    ds = p * (dp - delta)
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kh) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q).reshape(b, s, -1, g, d).sum(axis=3) * scale
    dv = np.einsum("bhqk,bqhd->bkhd", p, do).reshape(b, s, -1, g, d).sum(axis=3)
    dsinks = -(p_sink * delta[..., 0]).sum(axis=(0, 2))
    return out, (dq, dk, dv, dsinks)


def inputs(seed, b, s, h, hkv, d, *, shard=None):
    q, k, v, do, seg = random_inputs(seed, b, s, h, hkv, d, jnp.float32, shard=shard)
    # large enough to matter against scores of order one: some rows give the sink most of their weight
    sinks = 2.0 * jax.random.normal(jax.random.key(seed + 1), (h,), jnp.float32)
    return q, k, v, do, seg, sinks


def grads_of(fn, q, k, v, sinks, do):
    """``fn(q, k, v, sinks)`` and the gradients of ``sum(fn * do)`` with respect to all four."""
    def loss(q, k, v, sinks):
        out = fn(q, k, v, sinks)
        return jnp.sum(out * do), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
    return out, grads


def check(out, grads, ref_out, ref_grads, tol=TOL):
    assert rel_err(out, ref_out) < tol, rel_err(out, ref_out)
    for name, g, rg in zip(("q", "k", "v", "sinks"), grads, ref_grads):
        assert rel_err(g, rg) < tol, (name, rel_err(g, rg))


LOCAL = [  # impl, heads (H, Hkv), segment ids, window, S
    ("xla", (4, 2), True, 5, 24),
    pytest.param("xla", (4, 4), False, None, 24, marks=pytest.mark.slow),
    ("blockwise", (4, 2), True, 6, 40),  # 40 tokens in tiles of 16: padding, skipped tiles
    pytest.param("blockwise", (4, 1), False, None, 40, marks=pytest.mark.slow),
    ("pallas", (4, 2), True, 5, 40),  # interpret mode; 40 tokens padded to the tile
    pytest.param("pallas", (2, 2), False, None, 24, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("impl,heads,use_seg,window,s", LOCAL)
def test_local_attention_with_sinks_matches_f64(impl, heads, use_seg, window, s, seed):
    from ulysses_jax.kernels.blockwise import BlockSizes, blockwise_attention

    h, hkv = heads
    q, k, v, do, seg, sinks = inputs(seed, 2, s, h, hkv, 8)
    seg = seg if use_seg else None

    def fn(q, k, v, sinks):
        if impl == "blockwise":  # small tiles, so that tiles are skipped and padded
            return blockwise_attention(q, k, v, segment_ids=seg, window=window, sinks=sinks,
                                       block_sizes=BlockSizes(16, 16))
        return attention(q, k, v, segment_ids=seg, window=window, sinks=sinks, impl=impl)

    out, grads = grads_of(fn, q, k, v, sinks, do)
    ref_out, ref_grads = attention_sinks_f64(q, k, v, sinks, do, segment_ids=seg, window=window)
    check(out, grads, ref_out, ref_grads)


@pytest.mark.parametrize("impl", ["xla", "blockwise", "pallas"])
def test_sinks_none_is_unchanged_and_sinks_matter(impl, seed):
    """``sinks=None`` is today's attention, bit for bit; a sink of -inf is no sink; changing a head's sink changes
    that head's output, and only that head's."""
    q, k, v, _, seg, sinks = inputs(seed, 1, 24, 4, 2, 8)
    plain = attention(q, k, v, segment_ids=seg, impl=impl)
    assert np.array_equal(attention(q, k, v, segment_ids=seg, impl=impl, sinks=None), plain)
    none = attention(q, k, v, segment_ids=seg, impl=impl, sinks=jnp.full((4,), -jnp.inf))
    np.testing.assert_allclose(none, plain, rtol=1e-6, atol=1e-6)
    a = attention(q, k, v, segment_ids=seg, impl=impl, sinks=sinks)
    b = attention(q, k, v, segment_ids=seg, impl=impl, sinks=sinks.at[1].add(1.0))
    changed = np.abs(np.asarray(a) - np.asarray(b)).max(axis=(0, 1, 3))
    assert changed[1] > 1e-3 and np.all(changed[[0, 2, 3]] == 0), changed
    assert np.abs(np.asarray(a) - np.asarray(plain)).max() > 1e-3


def test_cudnn_refuses_sinks_and_auto_names_them():
    with pytest.raises(ValueError, match=r"impl='cudnn' cannot serve this call: cuDNN attention has no attention "
                                         r"sinks; use impl='pallas' or 'auto'"):
        resolve_impl("cudnn", dtype=jnp.bfloat16, head_dim=128, has_segment_ids=True, platform="gpu", sinks=True)
    assert resolve_impl("auto", dtype=jnp.bfloat16, head_dim=128, has_segment_ids=True, platform="gpu",
                        sinks=True) == "pallas"
    assert resolve_impl("auto", dtype=jnp.bfloat16, head_dim=128, has_segment_ids=True, platform="gpu") == "cudnn"
    assert "sinks" in auto_reason(dtype=jnp.bfloat16, head_dim=128, platform="gpu", sinks=True)
    assert auto_reason(dtype=jnp.bfloat16, head_dim=128, platform="gpu") is None
    q = jnp.ones((1, 8, 4, 8))
    with pytest.raises(ValueError, match=r"sinks must have shape \[num_heads\] = \(4,\)"):
        attention(q, q, q, sinks=jnp.zeros((2,)))
    with pytest.raises(ValueError, match=r"sinks must be floating point"):
        attention(q, q, q, sinks=jnp.zeros((4,), jnp.int32))


FAST_COMPILE = {"xla_backend_optimization_level": 0}  # the same program, faster CPU compiles (as test_ring.py)
DIST = [  # data, fsdp, ring, sp, heads (H, Hkv), segment ids, window, impl, keep
    (1, 2, 1, 4, (8, 2), True, None, "xla", False),  # FSDP x Ulysses, GQA: 2 query heads a device
    (1, 1, 1, 8, (6, 2), False, 5, "blockwise", False),  # 6 heads over 8 devices: dummy heads, copied KV heads
    (2, 1, 1, 4, (4, 4), True, 7, "blockwise", True),  # kept attention (attn_keep), data replicas
    (1, 1, 2, 4, (8, 2), True, None, "blockwise", False),  # Ulysses x ring
    pytest.param(1, 1, 4, 2, (4, 1), False, 6, "xla", False, marks=pytest.mark.slow),  # ring of 4, MQA, a window
    pytest.param(1, 1, 1, 4, (4, 2), True, 9, "pallas", True, marks=pytest.mark.slow),  # kept, Pallas (interpret)
    pytest.param(1, 1, 2, 2, (4, 2), True, None, "pallas", False, marks=pytest.mark.slow),  # ring of Pallas pairs
]


@pytest.mark.parametrize("data,fsdp,ring,sp,heads,use_seg,window,impl,keep", DIST)
def test_ulysses_with_sinks_matches_f64(data, fsdp, ring, sp, heads, use_seg, window, impl, keep, seed):
    mesh = make_mesh(data=data, fsdp=fsdp, ring=ring, sp=sp, devices=jax.devices()[: data * fsdp * ring * sp])
    h, hkv = heads
    s = 64
    q, k, v, do, seg, sinks = inputs(seed, 2 * data, s, h, hkv, 8, shard=s // (2 * ring * sp))
    seg = seg if use_seg else None

    def loss(q, k, v, sinks):
        out = ulysses_attention(q, k, v, mesh=mesh, segment_ids=seg, window=window, impl=impl, keep=keep, sinks=sinks)
        return jnp.sum(out * do), out

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (_, out), grads = fn.lower(q, k, v, sinks).compile(FAST_COMPILE)(q, k, v, sinks)
    ref_out, ref_grads = attention_sinks_f64(q, k, v, sinks, do, segment_ids=seg, window=window)
    check(out, grads, ref_out, ref_grads)


TILED = [  # impl, heads (H, Hkv), sp, head_chunk, recompute
    pytest.param("blockwise", (8, 2), 4, 1, False, marks=pytest.mark.slow),  # 2 groups of 1 head sharing a KV head
    ("xla", (6, 2), 4, 0, True),  # 6 heads over 4 devices: dummy heads; the output recomputed in the backward
    pytest.param("pallas", (4, 2), 2, 1, False, marks=pytest.mark.slow),  # Pallas (interpret), 2 groups a device
]


@pytest.mark.parametrize("impl,heads,sp,head_chunk,recompute", TILED)
def test_tiled_attention_head_groups_with_sinks(impl, heads, sp, head_chunk, recompute, seed):
    """The tiled sublayer (``attn_chunk``, ``attn_head_chunk``) with ``params["sinks"]``: output and the gradients of
    the input and every parameter, sinks included, equal the plain sublayer on one device (projections, then the
    reference attention with sinks, checked against float64 above)."""
    from ulysses_jax import ModelConfig
    from ulysses_jax.model.tiled_attention import project_chunk, tiled_attention

    h, hkv = heads
    cfg = ModelConfig.from_preset("llama3.2-1b", num_layers=1, hidden=32, num_heads=h, num_kv_heads=hkv, head_dim=8,
                                  mlp_dim=64, vocab_size=64, compute_dtype="float32", attention_impl=impl)
    b, s, dm = 2, 32, cfg.hidden
    ks = jax.random.split(jax.random.key(seed), 8)
    params = {"norm": 1.0 + 0.1 * jax.random.normal(ks[0], (dm,)),
              "wq": jax.random.normal(ks[1], (dm, h, 8)) / dm**0.5,
              "wk": jax.random.normal(ks[2], (dm, hkv, 8)) / dm**0.5,
              "wv": jax.random.normal(ks[3], (dm, hkv, 8)) / dm**0.5,
              "wo": jax.random.normal(ks[4], (h, 8, dm)) / (h * 8) ** 0.5,
              "sinks": 2.0 * jax.random.normal(ks[5], (h,))}
    x = jax.random.normal(ks[6], (b, s, dm))
    ct = jax.random.normal(ks[7], (b, s, dm))
    _, _, _, _, seg = random_inputs(seed, b, s, 1, 1, 8, jnp.float32, shard=s // sp)
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    mesh = make_mesh(data=1, fsdp=1, sp=sp, devices=jax.devices()[:sp])

    def plain(x, p):
        q, k, v = project_chunk(x, pos, p, cfg=cfg)
        o = attention(q, k, v, segment_ids=seg, scale=cfg.attn_scale, impl="xla", sinks=p["sinks"])
        return x + jnp.einsum("bsnh,nhd->bsd", o, p["wo"])

    def tiled(x, p):
        return tiled_attention(x, pos, seg, p, cfg=cfg, mesh=mesh, chunk=4, head_chunk=head_chunk,
                               recompute=recompute)

    def run(fn):
        step = jax.jit(jax.value_and_grad(lambda x, p: jnp.sum(fn(x, p) * ct), argnums=(0, 1)))
        return step.lower(x, params).compile(FAST_COMPILE)(x, params)

    (want, want_g), (got, got_g) = run(plain), run(tiled)
    # the value is a sum of b*s*d signed terms that cancel: its error is relative to the terms' size, not to the sum
    assert abs(float(got) - float(want)) < TOL * float(jnp.sum(jnp.abs(plain(x, params) * ct)))
    for name in ["x", *params]:
        g, w = (got_g[0], want_g[0]) if name == "x" else (got_g[1][name], want_g[1][name])
        assert rel_err(g, w) < TOL, (name, rel_err(g, w))
    bare = {k: v for k, v in params.items() if k != "sinks"}
    assert abs(float(jax.jit(lambda x: jnp.sum(tiled(x, bare) * ct))(x)) - float(got)) > 1e-3  # the sinks matter


@pytest.mark.parametrize("impl", ["xla", "blockwise", "pallas"])
def test_pair_kernels_put_the_sink_in_o_and_lse(impl, seed):
    """The ring's local kernels (what kept and tiled attention call) with ``sinks``: the sink inside the kernel equals
    the identity ``o * exp(lse - lse')``, ``lse' = logaddexp(lse, sink)`` applied to their output without it, rows
    that see no key (a padded document in a window) included: output 0, log-sum-exp the sink."""
    from ulysses_jax.kernels.sinks import with_sinks
    from ulysses_jax.parallel.ring import ring_kernel

    q, k, v, _, seg, sinks = inputs(seed, 2, 24, 4, 2, 8)
    seg_q = seg.at[0, 3].set(-5)  # a query whose document has no key: it sees nothing
    pos = jnp.arange(24, dtype=jnp.int32)
    kernel = ring_kernel(impl, "cpu")
    kw = dict(causal=True, scale=0.3, window=6)
    o, lse = kernel.forward(q, k, v, pos, pos, seg_q, seg, **kw)
    o_s, lse_s = kernel.forward(q, k, v, pos, pos, seg_q, seg, sinks=sinks, **kw)
    want_o, want_lse = with_sinks(o, lse, sinks)
    np.testing.assert_allclose(o_s, want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse_s, want_lse, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(o_s)[0, 3] == 0) and np.allclose(np.asarray(lse_s)[0, :, 3], sinks)
