"""The local XLA reference attention against the float64 NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from np_reference import TOL, attention_f64, random_inputs, rel_err

from ulysses_jax import attention
from ulysses_jax.attention import resolve_impl


HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("use_seg", [True, False], ids=["seg", "noseg"])
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
        ("auto", "bfloat16", 128, False, "cpu", "xla"),
        ("auto", "bfloat16", 128, True, "cpu", "xla"),
        ("auto", "bfloat16", 128, False, "gpu", "cudnn"),
        ("auto", "bfloat16", 128, True, "gpu", "pallas"),  # packed documents: cuDNN has no segment ids
        ("auto", "float32", 128, False, "gpu", "pallas"),
        ("auto", "bfloat16", 256, False, "gpu", "pallas"),
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
        ("bfloat16", True, "gpu", r"cuDNN attention takes no segment ids"),
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
