"""Local attention against the float64 NumPy reference: the XLA reference, the blockwise path (alone and inside
Ulysses on the 8 fake devices), and the impl rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from np_reference import TOL, attention_f64, random_inputs, rel_err

from ulysses_jax import attention, make_mesh, ulysses_attention
from ulysses_jax.kernels.attention import resolve_impl
from ulysses_jax.kernels.blockwise import BlockSizes, blockwise_attention, visited_tiles

HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
# segment ids x causal x head layout x dtype. The default suite keeps every head layout in both dtypes with segment
# ids and the causal mask, and GQA in float32 under the other three masks; `make test-slow` the rest.
MASK_GRID = [
    pytest.param(use_seg, causal, heads, dtype,
                 id=f"{'seg' if use_seg else 'noseg'}-{'causal' if causal else 'full'}-{heads}-{dtype}",
                 marks=[] if (use_seg and causal) or (heads, dtype) == ("gqa", "float32") else [pytest.mark.slow])
    for use_seg in (True, False) for causal in (True, False) for heads in HEADS for dtype in ("float32", "bfloat16")
]


@pytest.mark.parametrize("use_seg, causal, heads, dtype", MASK_GRID)
def test_xla_matches_f64(dtype, heads, causal, use_seg, seed):
    h, hkv = HEADS[heads]
    q, k, v, do, seg = random_inputs(seed, 2, 24, h, hkv, 8, jnp.dtype(dtype))
    seg = seg if use_seg else None

    def loss(q, k, v):
        out = attention(q, k, v, causal=causal, segment_ids=seg)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    ref_out, ref_grads = attention_f64(q, k, v, do, causal=causal, segment_ids=seg)
    assert out.dtype == q.dtype and all(g.dtype == q.dtype for g in grads)
    assert rel_err(out, ref_out) < TOL[dtype]
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert rel_err(g, rg) < TOL[dtype], name


def test_scale_and_segments_isolate_documents(seed):
    q, k, v, _, _ = random_inputs(seed, 1, 16, 2, 2, 8, jnp.float32)
    seg = jnp.array([[0] * 6 + [1] * 10])
    out = attention(q, k, v, causal=False, segment_ids=seg, scale=0.3)
    alone = attention(q[:, 6:], k[:, 6:], v[:, 6:], causal=False, scale=0.3)
    np.testing.assert_allclose(out[:, 6:], alone, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out, attention_f64(q, k, v, causal=False, segment_ids=seg, scale=0.3), atol=1e-5)


@pytest.mark.parametrize(
    "shapes, kwargs, match",
    [
        (((1, 8, 4, 8), (1, 8, 3, 8), (1, 8, 3, 8)), {}, r"query heads \(4\) must be a multiple of kv heads \(3\)"),
        (((1, 8, 4, 8), (1, 6, 2, 8), (1, 6, 2, 8)), {}, r"k/v shape \(1, 6, 2, 8\) does not match q shape"),
        (((1, 8, 4, 8), (1, 8, 2, 8), (1, 8, 1, 8)), {}, r"k and v must have the same shape"),
        (((8, 4, 8), (1, 8, 2, 8), (1, 8, 2, 8)), {}, r"q must have rank 4"),
        (((1, 8, 4, 8), (1, 8, 2, 8), (1, 8, 2, 8)), {"impl": "nope"}, r"unknown attention impl 'nope'"),
        (
            ((1, 8, 4, 8), (1, 8, 2, 8), (1, 8, 2, 8)),
            {"segment_ids": np.zeros((1, 7), np.int32)},
            r"segment_ids must have shape \[batch, seq\] = \(1, 8\)",
        ),
    ],
)
def test_invalid_inputs(shapes, kwargs, match):
    q, k, v = (jnp.ones(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, **kwargs)


@pytest.mark.parametrize(
    "impl, dtype, d, seg, backend, want",
    [
        ("auto", "bfloat16", 128, False, "cpu", "blockwise"),
        ("auto", "float32", 32, True, "cpu", "blockwise"),
        ("blockwise", "bfloat16", 64, True, "gpu", "blockwise"),
        ("auto", "bfloat16", 128, False, "gpu", "cudnn"),
        ("auto", "bfloat16", 128, True, "gpu", "cudnn"),  # packed documents: cuDNN's ragged layout
        ("auto", "float32", 128, False, "gpu", "pallas"),
        ("auto", "bfloat16", 256, False, "gpu", "cudnn"),  # on Hopper (the compile-only targets here)
        ("auto", "bfloat16", 264, False, "gpu", "pallas"),  # beyond cuDNN's 256
        ("pallas", "float32", 64, True, "cpu", "pallas"),
        ("xla", "bfloat16", 64, True, "gpu", "xla"),
        ("cudnn", "bfloat16", 64, False, "gpu", "cudnn"),
    ],
)
def test_resolve_impl(impl, dtype, d, seg, backend, want):
    assert resolve_impl(impl, dtype=jnp.dtype(dtype), head_dim=d, has_segment_ids=seg, platform=backend) == want


@pytest.mark.parametrize(
    "dtype, seg, backend, match",
    [
        ("bfloat16", False, "cpu", r"cuDNN needs a GPU but the devices' platform is 'cpu'"),
        ("float32", False, "gpu", r"cuDNN attention needs float16 or bfloat16 inputs, got float32"),
    ],
)
def test_cudnn_refuses_what_it_cannot_do(dtype, seg, backend, match):
    with pytest.raises(ValueError, match=r"impl='cudnn' cannot serve this call: " + match):
        resolve_impl("cudnn", dtype=jnp.dtype(dtype), head_dim=64, has_segment_ids=seg, platform=backend)


def test_cudnn_call_refused_on_cpu():
    x = jnp.ones((1, 8, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"impl='cudnn' cannot serve this call"):
        attention(x, x, x, impl="cudnn")


def test_pallas_dispatch_matches_f64(seed):
    q, k, v, do, seg = random_inputs(seed, 1, 40, 4, 2, 16, jnp.float32)
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, segment_ids=seg, impl="pallas"), q, k, v)
    ref_out, ref_grads = attention_f64(q, k, v, do, segment_ids=seg)
    assert rel_err(out, ref_out) < TOL["float32"]
    for g, rg in zip(vjp(do), ref_grads):
        assert rel_err(g, rg) < TOL["float32"]


# Blockwise: small tiles so that a short sequence has many of them; q and k tiles of different sizes; the odd
# length (37) is padded inside to 48.
SMALL_TILES = BlockSizes(block_q=8, block_k=16)


def blockwise_grads(q, k, v, do, **kwargs):
    def loss(q, k, v):
        out = blockwise_attention(q, k, v, **kwargs)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def assert_matches_f64(q, k, v, do, out, grads, dtype, **kwargs):
    ref_out, ref_grads = attention_f64(q, k, v, do, **kwargs)
    assert out.dtype == q.dtype and all(g.dtype == q.dtype for g in grads)
    assert rel_err(out, ref_out) < TOL[dtype]
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert rel_err(g, rg) < TOL[dtype], name


@pytest.mark.parametrize("use_seg, causal, heads, dtype", MASK_GRID)
def test_blockwise_matches_f64(dtype, heads, causal, use_seg, seed):
    """Outputs and gradients over many tiles, an odd length, 4 packed documents (tiles between them skipped)."""
    h, hkv = HEADS[heads]
    q, k, v, do, seg = random_inputs(seed, 2, 37, h, hkv, 8, jnp.dtype(dtype), n_docs=4)
    seg = seg if use_seg else None
    out, grads = blockwise_grads(q, k, v, do, causal=causal, segment_ids=seg, block_sizes=SMALL_TILES)
    assert_matches_f64(q, k, v, do, out, grads, dtype, causal=causal, segment_ids=seg)


@pytest.mark.parametrize("blocks", [BlockSizes(16, 8), BlockSizes(4, 4), BlockSizes(256, 256)], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_blockwise_any_tiles_and_unordered_ids(blocks, causal, seed):
    """Segment ids that are not contiguous documents (a token's document recurs later) and any tile shape,
    down to tiles of 4 and up to one tile larger than the sequence."""
    q, k, v, do, _ = random_inputs(seed, 2, 29, 4, 2, 8, jnp.float32)
    seg = jax.random.randint(jax.random.key(seed + 1), (2, 29), 0, 3)
    out, grads = blockwise_grads(q, k, v, do, causal=causal, segment_ids=seg, scale=0.4, block_sizes=blocks)
    assert_matches_f64(q, k, v, do, out, grads, "float32", causal=causal, segment_ids=seg, scale=0.4)


def test_blockwise_skips_masked_tiles():
    """Four packed documents of 16 tokens, tiles of 8: the only tiles computed are those on each document's
    causal diagonal (a padded length keeps that); without causality, each document's square."""
    seg = jnp.repeat(jnp.arange(4), 16)[None]
    doc = np.arange(8) // 2
    causal = (doc[:, None] == doc[None, :]) & (np.arange(8)[:, None] >= np.arange(8)[None, :])
    tiles = BlockSizes(8, 8)
    np.testing.assert_array_equal(visited_tiles(64, segment_ids=seg, block_sizes=tiles), causal)
    np.testing.assert_array_equal(visited_tiles(62, segment_ids=seg[:, :62], block_sizes=tiles), causal)
    np.testing.assert_array_equal(
        visited_tiles(64, causal=False, segment_ids=seg, block_sizes=tiles), doc[:, None] == doc[None, :]
    )
    assert float(visited_tiles(2048, block_sizes=BlockSizes(256, 256)).mean()) == 36 / 64  # causal alone


def test_blockwise_dispatch(seed):
    """attention(impl="blockwise") and impl="auto" on a CPU run the blockwise path and agree with the reference."""
    q, k, v, do, seg = random_inputs(seed, 1, 40, 4, 2, 16, jnp.float32)
    ref = attention(q, k, v, segment_ids=seg, impl="xla")
    for impl in ("blockwise", "auto"):
        out = attention(q, k, v, segment_ids=seg, impl=impl, platform="cpu")
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "mesh_shape, heads, dtype, causal",
    [((2, 4), "gqa", "float32", True), ((1, 8), "mqa", "bfloat16", True), ((4, 2), "mha", "float32", False)],
    ids=["fsdp2xsp4-gqa", "sp8-mqa-bf16", "fsdp4xsp2-full"],
)
def test_blockwise_inside_ulysses(mesh_shape, heads, dtype, causal, seed):
    """impl="auto" on the 8 fake CPU devices resolves to blockwise and runs between the two all-to-alls
    (shard_map with check_vma on): outputs and gradients against float64, documents crossing shards."""
    fsdp, sp = mesh_shape
    mesh = make_mesh(fsdp=fsdp, sp=sp)
    h, hkv = (8, 2) if heads == "gqa" else (8, 1) if heads == "mqa" else (8, 8)
    q, k, v, do, seg = random_inputs(seed, 4, 64, h, hkv, 16, jnp.dtype(dtype), shard=64 // sp)

    def loss(q, k, v):
        out = ulysses_attention(q, k, v, mesh=mesh, causal=causal, segment_ids=seg, impl="auto")
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    assert "blockwise" in str(jax.make_jaxpr(loss)(q, k, v))  # the custom_vjp of the blockwise kernel
    assert_matches_f64(q, k, v, do, out, grads, dtype, causal=causal, segment_ids=seg)


def test_rows_refused_padding_apart_and_host_arrays_through_every_entry():
    """Found by a review: `ulysses_attention` let one id's two runs attend to each other (its kernels see traced ids,
    which `attention()`'s check passes), where `attention()` refuses the row; without the causal mask, a leading
    document of 0s attended to the trailing zeros (padding: no document) in every kernel that compares ids; and
    `attention()` raised AttributeError on NumPy inputs."""
    q, k, v, _, _ = random_inputs(0, 1, 16, 4, 2, 16, jnp.float32)
    split = jnp.asarray([[1] * 6 + [2] * 6 + [1] * 4], jnp.int32)
    for ring, sp in ((1, 4), (2, 2)):
        mesh = make_mesh(ring=ring, sp=sp, devices=jax.devices()[:ring * sp])
        with pytest.raises(ValueError, match="row 0 uses segment id 1 for separate runs of tokens"):
            ulysses_attention(q, k, v, mesh=mesh, segment_ids=split, impl="xla")
    padded = jnp.asarray([[0] * 6 + [1] * 6 + [0] * 4], jnp.int32)  # ids from 0, then 4 tokens of padding
    apart = np.asarray([[0] * 6 + [1] * 6 + [2] * 4])  # the reference: padding in no document of the real tokens
    want = attention_f64(q, k, v, causal=False, segment_ids=apart)[:, :12]
    outs = {impl: attention(q, k, v, causal=False, segment_ids=padded, impl=impl)
            for impl in ("xla", "blockwise", "pallas")}
    for ring, sp in ((1, 4), (2, 2)):
        mesh = make_mesh(ring=ring, sp=sp, devices=jax.devices()[:ring * sp])
        outs[f"ring {ring} sp {sp}"] = ulysses_attention(q, k, v, mesh=mesh, causal=False, segment_ids=padded,
                                                         impl="xla")
    for name, out in outs.items():
        assert rel_err(np.asarray(out)[:, :12], want) < TOL["float32"], name
    host = attention(*(np.asarray(x) for x in (q, k, v)), segment_ids=np.asarray(padded), impl="auto")
    np.testing.assert_allclose(np.asarray(host), np.asarray(attention(q, k, v, segment_ids=padded, impl="auto")),
                               rtol=1e-6, atol=1e-6)
