"""Sliding-window attention in the local kernels: exact against the float64 reference (outputs and gradients), the
tiles each kernel visits counted against the formula, skipped tiles never read, bad windows refused."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from np_reference import TOL, attention_f64, random_inputs, rel_err

from ulysses_jax.kernels import window as win
from ulysses_jax.kernels.attention import attention
from ulysses_jax.kernels.blockwise import BlockSizes as BwBlocks
from ulysses_jax.kernels.blockwise import blockwise_attention, visited_tiles
from ulysses_jax.kernels.flash_attention import flash_attention, kv_block_bound, kv_block_start, q_block_range
from ulysses_jax.kernels.flash_blocks import BlockSizes

TILE = 16
FLASH_TILES = BlockSizes(TILE, TILE, TILE, TILE, TILE, TILE)


def _impl(name):
    if name == "xla":
        return functools.partial(attention, impl="xla")
    if name == "blockwise":
        return functools.partial(blockwise_attention, block_sizes=BwBlocks(TILE, TILE))
    return functools.partial(flash_attention, block_sizes=FLASH_TILES, interpret=True)


# windows smaller than, equal to and larger than a tile; documents cross tiles and windows. Each call runs eagerly
# (op by op, 5-25 s): the default suite keeps each kernel at one of the three windows, `make test-slow` the rest.
WINDOW_CASES = [(window, impl) if (window, impl) in {(5, "xla"), (TILE, "blockwise"), (40, "pallas")} else
                pytest.param(window, impl, marks=pytest.mark.slow)
                for impl in ("xla", "blockwise", "pallas") for window in (5, TILE, 40)]


@pytest.mark.parametrize("window, impl", WINDOW_CASES)
def test_window_matches_float64(impl, window, seed):
    q, k, v, do, seg = random_inputs(seed, 2, 72, 4, 2, 16, jnp.float32, n_docs=3)  # 72: a padded last tile
    fn = _impl(impl)
    for ids in (None, seg):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, causal=True, segment_ids=ids, window=window), q, k, v)
        got = (out, *vjp(do))
        want_out, want_grads = attention_f64(q, k, v, do, causal=True, segment_ids=ids, window=window)
        for name, x, w in zip(("out", "dq", "dk", "dv"), got, (want_out, *want_grads)):
            assert rel_err(x, w) < TOL["float32"], (impl, window, ids is None, name, rel_err(x, w))
    # the window changes the answer (a test that cannot fail otherwise)
    assert rel_err(fn(q, k, v, causal=True), attention_f64(q, k, v, causal=True, window=window)) > 1e-3


def _brute_tiles(n_q, n_k, bq, bk, seq_len, window, offset=0):
    """(query tile, KV tile) pairs holding an allowed (query, key) pair, by enumeration."""
    live = set()
    for i in range(n_q):
        for j in range(n_k):
            q = np.arange(i * bq, (i + 1) * bq) + offset
            k = np.arange(j * bk, min((j + 1) * bk, seq_len))
            if k.size and ((q[:, None] >= k[None, :]) & (q[:, None] - k[None, :] < window)).any():
                live.add((i, j))
    return live


@pytest.mark.parametrize("bq,bk,seq_len,window,offset", [(16, 16, 64, 5, 0), (16, 16, 64, 16, 0), (32, 16, 100, 40, 0),
                                                          (16, 32, 100, 17, 0), (16, 16, 64, 20, 32),
                                                          (16, 16, 64, 50, 48)], ids=str)
def test_tile_bounds_are_exactly_the_live_tiles(bq, bk, seq_len, window, offset):
    s_pad = -(-seq_len // max(bq, bk)) * max(bq, bk)
    n_q, n_k = s_pad // bq, s_pad // bk
    live = _brute_tiles(n_q, n_k, bq, bk, seq_len, window, offset)
    kw = dict(block_q=bq, block_k=bk, seq_len=seq_len, causal=True, window=window, offset=offset)
    fwd = {(i, j) for i in range(n_q) for j in range(int(kv_block_start(i, **kw)), int(kv_block_bound(i, **kw)))}
    bwd = {(i, j) for j in range(n_k) for i in range(*map(int, q_block_range(j, **kw)))}
    # the dK/dV pass may keep padded query tiles out; nothing else differs
    assert fwd == live
    assert bwd == {(i, j) for i, j in live if i * bq < seq_len}


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40, 1000])
def test_visited_tiles_count_matches_the_formula(window):
    """Square tiles of 16, S = 256 (16 tiles): query tile i visits min(i, ceil((W - 1) / 16)) + 1 KV tiles."""
    n, s = 16, 256
    want = sum(min(i, -(-(window - 1) // TILE)) + 1 for i in range(n))
    assert win.window_tile_count(n, TILE, window) == want
    assert int(visited_tiles(s, block_sizes=BwBlocks(TILE, TILE), window=window).sum()) == want  # blockwise
    kw = dict(block_q=TILE, block_k=TILE, seq_len=s, causal=True, window=window)
    assert sum(int(kv_block_bound(i, **kw)) - int(kv_block_start(i, **kw)) for i in range(n)) == want  # Pallas fwd, dQ
    assert sum(int(np.subtract(*q_block_range(j, **kw)[::-1])) for j in range(n)) == want  # Pallas dK/dV
    if window < s:
        assert want < n * (n + 1) // 2  # fewer than causal alone


@pytest.mark.parametrize("impl", ["blockwise", "pallas"])
def test_skipped_tiles_are_never_read(impl):
    """NaN in every key tile outside the last query tile's window: its output and dQ stay finite and exact."""
    b, s, h, d, window = 1, 64, 2, 16, 5
    rng = np.random.default_rng(7)
    q, k, v, do = (jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32) for _ in range(4))
    fn = functools.partial(_impl(impl), causal=True, window=window)
    cut = s - 2 * TILE  # the last query tile [48, 64) reads keys from 44 on: tiles 2 and 3
    k_bad, v_bad = k.at[:, :cut].set(jnp.nan), v.at[:, :cut].set(jnp.nan)
    out, vjp = jax.vjp(lambda q: fn(q, k_bad, v_bad), q)
    want_out, want_vjp = jax.vjp(lambda q: fn(q, k, v), q)
    np.testing.assert_allclose(out[:, -TILE:], want_out[:, -TILE:], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(vjp(do)[0][:, -TILE:], want_vjp(do)[0][:, -TILE:], rtol=1e-6, atol=1e-6)
    # without the window the poison reaches it (the method can fail)
    assert np.isnan(np.asarray(_impl(impl)(q, k_bad, v_bad, causal=True)[:, -TILE:])).all()


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_window_is_refused(bad):
    q = jnp.zeros((1, 8, 2, 8))
    for impl in ("xla", "blockwise", "pallas"):
        with pytest.raises(ValueError, match=r"window \(.*\) must be a positive number of tokens"):
            attention(q, q, q, window=bad, impl=impl, platform="cpu")
    with pytest.raises(ValueError, match="pass causal=True"):
        attention(q, q, q, causal=False, window=4)


def test_block_kind_with_a_window():
    run = np.arange
    assert win.block_kind(run(8, 16), run(0, 8), True, None) == win.FULL
    assert win.block_kind(run(8, 16), run(0, 8), True, 4) == win.MASKED
    assert win.block_kind(run(16, 24), run(0, 8), True, 9) == win.SKIP  # 16 - 9 = 7: key 7 is out
    assert win.block_kind(run(16, 24), run(0, 8), True, 10) == win.MASKED
    assert win.block_kind(run(8, 16), run(0, 8), True, 16) == win.FULL  # 15 - 16 < 0: every key inside
    assert win.block_kind(run(0, 8), run(8, 16), True, 4) == win.SKIP


@pytest.mark.parametrize("axes, shape, impl", [(("fsdp", "sp"), (2, 4), "blockwise"), (("ring", "sp"), (2, 4), "xla"),
                                               (("ring", "sp"), (4, 2), "blockwise")], ids=str)
def test_ulysses_attention_with_a_window(axes, shape, impl, seed):
    """Ulysses (each device holds the whole sequence of its heads) and Ulysses x ring: the windowed answer."""
    from jax.sharding import AxisType

    from ulysses_jax.parallel.ulysses import ulysses_attention

    mesh = jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])
    q, k, v, do, seg = random_inputs(seed, 2, 64, 8, 4, 16, jnp.float32, shard=8)
    fn = functools.partial(ulysses_attention, mesh=mesh, segment_ids=seg, impl=impl, window=11)
    out, vjp = jax.vjp(jax.jit(fn), q, k, v)
    want_out, want_grads = attention_f64(q, k, v, do, segment_ids=seg, window=11)
    for name, x, w in zip(("out", "dq", "dk", "dv"), (out, *vjp(do)), (want_out, *want_grads)):
        assert rel_err(x, w) < TOL["float32"], (name, rel_err(x, w))


def test_cudnn_window_convention(monkeypatch):
    """``attention(impl="cudnn", window=W)`` hands jax's cuDNN path ``local_window_size=(W - 1, 0)``: the call is
    taken from ``ulysses_jax.kernels.attention`` itself (with the platform claimed as a GPU) and run by jax's own XLA
    implementation of the same arguments, which must give the float64 windowed answer. An off-by-one in the window
    (``(W, 0)``) or a dropped window fails it (the cuDNN kernel itself runs only on a GPU: test_gpu.py)."""
    q, k, v, _, _ = random_inputs(3, 1, 40, 4, 2, 16, jnp.float32)
    real = jax.nn.dot_product_attention
    seen = []

    def on_xla(*args, implementation=None, **kwargs):
        seen.append((implementation, kwargs.get("local_window_size")))
        return real(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", on_xla)
    monkeypatch.setattr("ulysses_jax.kernels.attention.resolve_impl", lambda impl, **kw: impl)  # let cudnn through
    for window in (1, 7, 16):
        got = attention(q, k, v, window=window, impl="cudnn", platform="gpu")
        assert seen[-1] == ("cudnn", (window - 1, 0))
        assert rel_err(got, attention_f64(q, k, v, window=window)) < TOL["float32"]


@pytest.mark.aot
def test_cudnn_window_compiles_for_h100():
    """The compile-only H100 accepts cuDNN's sliding window, forward and backward: two fused-attention calls whose
    configuration carries the window length."""
    from jax.sharding import SingleDeviceSharding

    from ulysses_jax.plan.targets import target_devices

    dev = target_devices("h100", devices=1)[0]
    q = jax.ShapeDtypeStruct((1, 2048, 8, 128), jnp.bfloat16, sharding=SingleDeviceSharding(dev))
    kv = jax.ShapeDtypeStruct((1, 2048, 4, 128), jnp.bfloat16, sharding=SingleDeviceSharding(dev))

    def loss(q, k, v):
        return attention(q, k, v, window=512, impl="cudnn", platform="gpu").astype(jnp.float32).sum()

    with jax.default_device(dev):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower().compile().as_text()
    assert text.count("__cudnn$fmha") == 2
    assert text.count('"sliding_window_length": 512') == 2 or text.count('sliding_window_length":512') == 2
