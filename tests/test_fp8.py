"""Float8 projections (``--fp8``, ``model/fp8.py``): the projection against a float32 reference that quantises by
hand, overflow and NaN, the delayed recipe's history, the float8 model beside the bf16 one, eight devices against one
(FSDP x Ulysses, remat, the tiled sublayers, LoRA), training and an exact resume, a Hugging Face start, refusals, the
compiled H100 program's float8 dots and plan's estimate; slow: ten steps against bf16, the real entry point's 30-step
run and resume, and eight devices with the tiled sublayers, remat and LoRA.

Two float8 runs are compared in one of two ways. Where they quantise the same tensors with the same scales, they are
equal to float32 summation order unless that order flips a float8 rounding, and a test takes the first of its draws
that flips none (``a_draw_flips_no_rounding``). Where their scales differ (the bf16 model, a chunk's own scales), each
draw differs by float8's noise, and the bounds were measured over hundreds of seeds, each with its figures.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import USERS_CPU_CODEGEN
from flax import nnx

from ulysses_jax import ModelConfig, Transformer, make_mesh, shift_labels
from ulysses_jax.model import fp8, fp8_base, lora
from ulysses_jax.model.lora_config import LoraConfig
from ulysses_jax.train.checkpoint import Checkpointer
from ulysses_jax.train.step import (
    OptimConfig,
    _loss_sums,
    abstract_state,
    init_state,
    make_optimizer,
    make_schedule,
    make_train_step,
    state_shardings,
)

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST
V = 256
FAST = {"xla_backend_optimization_level": 0}
BASE = ModelConfig(num_layers=2, hidden=64, num_heads=8, num_kv_heads=4, head_dim=8, mlp_dim=128, vocab_size=V,
                   compute_dtype="bfloat16", attention_impl="xla")


def qdq(t, dtype, amax):
    """The reference's quantisation, written out: scale amax / max (1 for zeros), clip, cast, back to float32."""
    m = float(jnp.finfo(dtype).max)
    s = jnp.where(amax == 0, 1.0, amax / m)
    return jnp.clip(t.astype(F32) / s, -m, m).astype(dtype).astype(F32) * s


def reference(spec, x, w, dy, amaxes):
    """float32 GEMMs of the dequantised operands: ``(y, dx, dw)``, ``amaxes`` the scales' (x, w, dy)."""
    xr, wr, dyr = qdq(x, fp8.E4M3, amaxes[0]), qdq(w, fp8.E4M3, amaxes[1]), qdq(dy, fp8.E5M2, amaxes[2])
    ins, out = spec.split("->")
    a, b = ins.split(",")
    return (jnp.einsum(spec, xr, wr, precision=HIGHEST), jnp.einsum(f"{out},{b}->{a}", dyr, wr, precision=HIGHEST),
            jnp.einsum(f"{a},{out}->{b}", xr, dyr, precision=HIGHEST))


def max_rel(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))


def operands(seed, shapes, dtype):
    """Fresh random operands whose magnitudes differ by orders (so every scale matters)."""
    k = jax.random.split(jax.random.key(seed), 3)
    return [(s * jax.random.normal(kk, shape)).astype(dtype) for kk, shape, s in zip(k, shapes, (3.0, 0.05, 1e-4))]


SPECS = {  # the projections' contractions: q/k/v, o, the MLP
    "qkv": ("bsd,dnh->bsnh", [(2, 16, 32), (32, 4, 8), (2, 16, 4, 8)]),
    "o": ("bsnh,nhd->bsd", [(2, 16, 4, 8), (4, 8, 32), (2, 16, 32)]),
    "mlp": ("bsd,df->bsf", [(2, 8, 32), (32, 48), (2, 8, 48)]),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", list(SPECS))
def test_projection_equals_the_quantised_reference(name, dtype, seed):
    """Output, dX and dW equal float32 GEMMs of operands quantised by hand with the same scales: to float32 rounding
    (measured <= 2.2e-7 relative); in bfloat16 to four roundings (``fp8._dot_to``: the GEMM writes bfloat16 and the
    product is rescaled in it, the scale rounded too, three roundings where the reference rounds once; on a GPU
    cuBLASLt folds the rescale into the GEMM, two; before, one rounding apart: 2^-8; 20 seeds drew 2.2 x 2^-8);
    in float16 to two of its roundings (the float32 product rescaled, then cast: its unscaled products, up to 448^2,
    would overflow float16, whose result was inf when it took bfloat16's path); with a history too."""
    spec, shapes = SPECS[name]
    x, w, dy = operands(seed, shapes, dtype)
    tol = {jnp.float32: 1e-6, jnp.bfloat16: 4 * 2.0**-8, jnp.float16: 2 * 2.0**-11}[dtype]
    current = [jnp.max(jnp.abs(t)).astype(F32) for t in (x, w, dy)]
    spread = jax.random.uniform(jax.random.key(seed + 1), (3, fp8.HISTORY), F32, 0.5, 1.5)
    history = spread * jnp.stack(current)[:, None]  # some entries above this step's amax, some below
    for hist, used in ((None, current), (history, list(jnp.max(history, axis=1)))):
        y, vjp = jax.vjp(lambda x, w, h: fp8.fp8_einsum(spec, x, w, h), x, w, hist)
        dx, dw, new = vjp(dy)
        assert y.dtype == dx.dtype == dw.dtype == dtype
        for got, want in zip((y, dx, dw), reference(spec, x, w, dy, used)):
            assert max_rel(got, want.astype(dtype)) <= tol
        if hist is not None:  # the history's "gradient": rolled, this step's amaxes first
            np.testing.assert_array_equal(new[:, 1:], hist[:, :-1])
            np.testing.assert_array_equal(new[:, 0], jnp.stack(current))


def test_overflow_saturates_and_a_nan_or_inf_propagates():
    assert fp8.quantize(jnp.array([1000.0, -1e6, 3.0]), fp8.E4M3, jnp.float32(1)).astype(F32).tolist() == [448, -448, 3]
    assert fp8.quantize(jnp.array([1e9]), fp8.E5M2, jnp.float32(1)).astype(F32).tolist() == [57344]
    x, w = jnp.array([[1.0, -2.0, 3.0, 0.5]]), jnp.eye(4)
    # delayed: a history whose max (1.0) is below this step's amax (3.0): values beyond 448 x (1 / 448) saturate
    hist = jnp.ones((3, fp8.HISTORY))
    y = fp8.fp8_einsum("bd,df->bf", x, w, hist)
    np.testing.assert_allclose(y, [[1.0, -1.0, 1.0, 0.5]], rtol=1e-6)  # 3 and -2 clipped to +-1: finite
    for bad in (jnp.nan, jnp.inf):
        for h in (None, hist):  # with a history too: its max must not stand in for a non-finite amax (a review:
            # delayed clipped an inf to 448 x the scale, and the step's loss and gradients came out finite)
            assert np.isnan(fp8.fp8_einsum("bd,df->bf", x.at[0, 0].set(bad), w, h)).all()
            _, vjp = jax.vjp(lambda x, w: fp8.fp8_einsum("bd,df->bf", x, w, h), x, w)
            assert all(np.isnan(g).all() for g in vjp(jnp.ones((1, 4)).at[0, 1].set(bad)))
    assert fp8.fp8_einsum("bd,df->bf", jnp.zeros((1, 4)), w, None).tolist() == [[0.0] * 4]  # all-zero: scale 1
    # a finite, tiny tensor (amax 1e-36: amax / 448 is subnormal, flushed to 0) gave NaN (found by a review)
    tiny = jnp.array([[1e-36, -1e-36, 5e-37, 0.0]])
    y, vjp = jax.vjp(lambda x, w: fp8.fp8_einsum("bd,df->bf", x, w, None), tiny, w)
    assert all(np.isfinite(g).all() for g in (y, *vjp(tiny))) and np.abs(np.asarray(y)).max() <= 1e-36


def batch(seed, b=4, s=64):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, V, (b, s), dtype=np.int32))
    seg = jnp.asarray((np.arange(s)[None] >= rng.integers(8, s - 8, (b, 1))).astype(np.int32))
    return dict(tokens=tokens, labels=shift_labels(tokens, seg), segment_ids=seg)


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST)
def loss_and_grads(graphdef, state, b):
    """``(mean loss, (gradients of the rest, the histories' new values or None))``; LoRA: the adapters' alone."""
    rest, hist = fp8.split(state)
    rest, frozen = lora.split(rest)
    f = lambda p, h: _loss_sums(graphdef, fp8.join(lora.join(p, frozen), h), b)  # noqa: E731
    (total, sums), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(rest, hist)
    return total / sums["count"], grads


loss_and_grads_as_users = jax.jit(loss_and_grads.__wrapped__, static_argnums=0,
                                  compiler_options={**FAST, **USERS_CPU_CODEGEN})


def build(cfg, mesh, seed, at_rest=True):
    """The model of ``seed``, every parameter shifted by seeded noise (LoRA's B is no longer zero); LoRA's base put in
    float8 after the noise (``fp8_base``), or left as it is (``at_rest=False``: the step quantises it)."""
    with mock.patch.object(fp8_base, "applies", lambda c: False):
        model = Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    params, _ = fp8.split(nnx.state(model, nnx.Param))  # the histories stay empty
    leaves, treedef = jax.tree.flatten(params)
    noisy = [np.asarray(x) + (0.05 * rng.standard_normal(x.shape)).astype(x.dtype) for x in leaves]
    nnx.update(model, jax.tree.unflatten(treedef, [jax.device_put(n, x.sharding) for n, x in zip(noisy, leaves)]))
    if at_rest and fp8_base.applies(cfg):
        fp8_base.freeze(model.blocks, cfg, mesh)
    return model


def flat(tree):
    return {k: np.asarray(v.get_value(), np.float64) for k, v in nnx.to_flat_state(tree)}


def cosine(a, b):
    a, b = a.ravel(), b.ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def norm_ratio(a, ref):
    return float(np.linalg.norm(a) / np.linalg.norm(ref))


def one_device():
    return make_mesh(fsdp=1, sp=1, devices=jax.devices()[:1])


DRAWS = 20


def a_draw_flips_no_rounding(compare, seed, draws=DRAWS) -> int:
    """Which of the draws ``seed``, ``seed + 1``, ... is the first that ``compare`` finds exact (at most ``draws``).

    Two float8 computations that quantise the same tensors with the same scales but sum in float32 in other orders
    are equal, unless an order moves a value across a float8 rounding boundary (e5m2 keeps two mantissa bits: the
    element moves by up to 25%, and a moved amax rescales its whole tensor). In the tests that use this, 1 draw in 3 to
    1 in 6 flips something (500 and 1,000 seeds; 60 of each case counted since), and the gradients then differ by any
    amount up to ~0.2 of their largest element: no fixed bound sits above that tail (each bound held before was crossed
    by some seed). So ``compare(s)`` asserts, on every draw, the bounds that hold whatever flips (float8's noise: a
    gradient lost, halved or sent to other heads is far outside them) and returns ``(exact, differences)``; the first
    exact draw ends the search, and none in ``draws`` fails the test (all 20 flipping, at 1 in 3 each: ~3e-10)."""
    seen = {}
    for i in range(draws):
        s = (seed + i) % 2**31
        exact, seen[s] = compare(s)
        if exact:
            return i
    raise AssertionError(f"each of {draws} draws differed beyond float32 summation order: {seen}")


def assert_float8_noise(got, ref):
    """Each gradient of ``got`` within float8's noise of ``ref``'s (both ``{key: array}``): cosine above 0.95, norm
    within 10%; what ``a_draw_flips_no_rounding``'s callers hold on every draw, exact or not."""
    norm = {k: norm_ratio(got[k], ref[k]) for k in ref}
    assert all(cosine(got[k], ref[k]) > 0.95 and abs(norm[k] - 1) < 0.1 for k in ref), {
        k: (max_rel(got[k], ref[k]), cosine(got[k], ref[k]), norm[k]) for k in ref}


def test_float8_model_is_close_to_the_bf16_model(seed):
    """2 layers, bf16 compute, one device. Over 400 seeds (2026-11-29): loss within 1.02e-3 (relative) of the bf16
    model's, each parameter's gradient at cosine >= 0.9793 with the bf16 one (median 0.9885; wq and wk the lowest), all
    together >= 0.9889 (the same figures at cbd1c4a, where this test began: the 6-seed figures it quoted, 0.9937 and
    0.998, were not these, and 2 of 300 seeds crossed its 0.98 and 0.99). Held at 5e-3, 0.95 and 0.97: a float8 scale
    gone wrong (448x) or a gradient lost (cosine ~0) is far outside."""
    mesh, b = one_device(), batch(seed)
    (l16, (g16, _)), (l8, (g8, _)) = (loss_and_grads(*nnx.split(build(c, mesh, seed)), b)
                                      for c in (BASE, dataclasses.replace(BASE, fp8=True)))
    assert abs(float(l8) / float(l16) - 1) < 5e-3
    f16, f8 = flat(g16), flat(g8)
    assert min(cosine(f8[k], f16[k]) for k in f16) > 0.95, {k: cosine(f8[k], f16[k]) for k in f16}
    assert cosine(np.concatenate([f8[k].ravel() for k in f16]), np.concatenate([f16[k].ravel() for k in f16])) > 0.97


CASES = {  # name -> (recipe, ModelConfig fields on fsdp 2 x sp 4; the reference: one device, plain)
    "plain": ("current", {}),
    "remat-mlp_chunk": ("delayed", dict(remat="full", mlp_chunk=4)),
    "attn_chunk-groups": ("delayed", dict(attn_chunk=4, attn_head_chunk=1)),
    "lora-mlp_chunk": ("current", dict(mlp_chunk=4, lora=LoraConfig(rank=4, alpha=8.0,
                                                                     targets="q,k,v,o,gate,up,down"))),
}


@functools.lru_cache(maxsize=None)
def one_device_reference(cfg, seed):
    """The plain model of ``cfg`` on one device (cases of the same recipe share it)."""
    return loss_and_grads(*nnx.split(build(cfg, one_device(), seed)), batch(seed, b=8))


@pytest.mark.parametrize("case", list(CASES))
def test_eight_devices_equal_one(case, seed):
    """fsdp 2 x sp 4 against one device. Plain: the same scales (each an amax over the whole tensor, an all-reduce
    under sharding), so equal to float32 summation order (loss to 2e-6, each gradient to 1e-5 of its largest; measured
    6.8e-7 and 9.9e-6 over 1,000 seeds), unless that order flips a float8 rounding (161 of those 1,000 seeds did: the
    loss then up to 1.7e-4 apart, a gradient's cosine down to 0.9906 and its norm 3.2% off; the bounds held before,
    1e-4, 0.99 and 2%, were crossed by 6 of them): every draw is held to float8's noise (loss 1e-3, cosine 0.95, norm
    within 10%: a wrong gradient, a missing sum or scale is far outside), the first that flips nothing to the exact
    bounds (``a_draw_flips_no_rounding``). Tiled (mlp_chunk, attn_chunk): each chunk of each device is scaled on its
    own, so float8 rounding differs on every draw: over 400 seeds of each case the loss within 7.7e-4, each
    gradient's cosine >= 0.9807 and norm within 6.1% of one device's (the 1e-3, 0.98 and 10% held before were
    measured on 6 seeds; the lowest cosine of those 1,200 was 7e-4 above 0.98); held at 3e-3, 0.95 and 15%: a gradient
    summed over too few or too many devices (half or twice the norm), or one head's of eight lost (cosine ~0.935), is
    outside. The delayed recipe's history: the weights' amaxes equal, the inputs' of the first projections too."""
    recipe, fields = CASES[case]
    cfg = dataclasses.replace(BASE, compute_dtype="float32", fp8=True, fp8_recipe=recipe, lora=fields.get("lora"))

    def run(s):
        l1, (g1, h1) = one_device_reference(cfg, s)
        l8, (g8, h8) = loss_and_grads(*nnx.split(build(dataclasses.replace(cfg, **fields), make_mesh(fsdp=2, sp=4),
                                                       s)), batch(s, b=8))
        f1, f8 = flat(g1), flat(g8)
        assert f1.keys() == f8.keys()
        return float(l1), f1, h1, float(l8), f8, h8

    if case == "plain":
        def compare(s):
            l1, f1, _, l8, f8, _ = run(s)
            loss = abs(l8 / l1 - 1)
            assert loss < 1e-3, loss
            assert_float8_noise(f8, f1)
            rel = {k: max_rel(f8[k], f1[k]) for k in f1}
            return loss < 2e-6 and max(rel.values()) < 1e-5, {"loss": loss, **rel}

        a_draw_flips_no_rounding(compare, seed)
        return
    l1, f1, h1, l8, f8, h8 = run(seed)
    assert abs(l8 / l1 - 1) < 3e-3
    assert min(cosine(f8[k], f1[k]) for k in f1) > 0.95, {k: cosine(f8[k], f1[k]) for k in f1}
    ratios = {k: norm_ratio(f8[k], f1[k]) for k in f1}
    assert all(abs(r - 1) < 0.15 for r in ratios.values()), ratios
    if recipe == "delayed":
        for k, h in flat(h1).items():
            got = flat(h8)[k]
            assert (got[..., 1:] == 0).all() and (got[..., 0] > 0).all()  # one step: slot 0 written, the rest empty
            np.testing.assert_allclose(got[:, :, 1, 0], h[:, :, 1, 0], rtol=1e-6)  # weights: the same tensors
            if "attn" in k:  # the first layer's q, k, v input: the normed embeddings, whatever the tiling
                np.testing.assert_allclose(got[0, :3, 0, 0], h[0, :3, 0, 0], rtol=1e-5)


LORA_ALL = LoraConfig(rank=4, alpha=8.0, targets="q,k,v,o,gate,up,down")


def test_lora_base_under_the_tiled_attention_rests_in_its_layout():
    """LoRA + --fp8 + --attn-chunk on fsdp 2 x sp 4: the frozen attention weights rest in the layout the tiled
    sublayer's shard_map takes them in, so the compiled step moves no weight between layouts each layer: as many
    all-to-alls as the same step without float8 (a review found 2 more a layer: Llama-3.1-8B's LoRA at 128K on 8
    compile-only H100s moved 44 GiB in all-to-alls a step instead of 40)."""
    cfg = dataclasses.replace(BASE, compute_dtype="float32", lora=LORA_ALL, attn_chunk=4)
    mesh, b = make_mesh(fsdp=2, sp=4), batch(0, b=8)
    counts = {}
    for f8 in (False, True):
        graphdef, state = nnx.split(build(dataclasses.replace(cfg, fp8=f8), mesh, 0))
        text = loss_and_grads.lower(graphdef, state, b).compile().as_text()
        counts[f8] = text.count(" all-to-all(")
    assert counts[True] == counts[False] > 0, counts


HYBRID = dict(num_layers=2, layer_pattern=("linear", "global"), linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=32, linear_value_head_dim=32)


# the default suite keeps the plain sublayers; the delayed recipe with the tiled MLP, the tiled attention and a hybrid
# (16-32 s each on 2 cores) run with `make test-slow`
@pytest.mark.parametrize("recipe, fields", [
    ("current", {}), pytest.param("delayed", dict(mlp_chunk=4, remat="full"), marks=pytest.mark.slow),
    pytest.param("current", dict(attn_chunk=4), marks=pytest.mark.slow),
    pytest.param("current", HYBRID, marks=pytest.mark.slow)])
def test_lora_base_at_rest_gives_the_per_step_values(recipe, fields, seed):
    """LoRA + --fp8 on fsdp 2 x sp 4: the base's seven projections stored in float8 once (``fp8_base``) give the loss,
    the adapters' gradients and the amax histories of quantising them in every step, bit for bit, with either recipe (a
    frozen weight's amax never changes); the plain sublayers and the tiled MLP. Unless one weight's quotient sits on a
    float8 rounding tie: the quantiser alone and the compiled step round it apart (seed 7017: one element of w_gate,
    84.0000128 times its scale, stored as e4m3's 80, 88 in the step; with 88 stored, the loss equal bit for bit): 2 of
    150 seeds of the plain sublayers, 1 of 100 with the tiled MLP, 4 of 100 of the hybrid (2026-11-29; the loss then
    up to 4.9e-5 apart, a gradient's cosine >= 0.991, its norm within 2.3%). So every draw is held to float8's noise
    (loss 1e-3, cosine 0.95, norm within 10%: a lost or misplaced gradient is far outside) and the first that rounds
    alike to bit for bit (``a_draw_flips_no_rounding``). The tiled attention sublayer merges the adapters into the
    dequantised base (the values every step computed with) and quantises that: one more rounding of the base, so not
    equal; against the model without --fp8 its gradients are about as close as the per-step path's (250 seeds: each
    gradient's cosine >= 0.9791 at rest, >= 0.9815 per step; loss within 1.06e-3 and 7.6e-4; 4 of 150 seeds crossed
    the 0.98 held before, measured on 4; held at 0.95 and 3e-3). The stored copies, on every draw: float8, the second
    the first with the output dimensions first, the amaxes each layer's."""
    lora_cfg = dataclasses.replace(LORA_ALL, targets="q,k,v,o,gate,up,down,in_proj_qkv,out_proj") if (
        "layer_pattern" in fields) else LORA_ALL
    cfg = dataclasses.replace(BASE, compute_dtype="float32", fp8=True, fp8_recipe=recipe, lora=lora_cfg, **fields)
    mesh = make_mesh(fsdp=2, sp=4)

    def models(s):
        per_step, at_rest = build(cfg, mesh, s, at_rest=False), build(cfg, mesh, s)
        weights = [("mlp", "w_up_DF", (0, 2, 1)), ("attn", "wo_NHD", (0, 3, 1, 2))]
        if "layer_pattern" in fields:  # the delta-net's: q, k, v, z one amax per layer (one GEMM), the output its own
            weights += [("delta", "wo_UWD", (0, 3, 1, 2))]
            shared = [getattr(at_rest.blocks.delta, n + fp8_base.AMAX).get_value() for n in fp8_base.SHARED["delta"]]
            ws = [np.abs(np.asarray(getattr(per_step.blocks.delta, n).get_value())) for n in fp8_base.SHARED["delta"]]
            np.testing.assert_array_equal(np.asarray(shared[0]),
                                          np.max([w.reshape(len(w), -1).max(axis=1) for w in ws], 0))
            assert all(np.array_equal(a, shared[0]) for a in shared)
        for module, attr, order in weights:
            w = np.asarray(getattr(getattr(per_step.blocks, module), attr).get_value(), np.float32)
            stored = getattr(at_rest.blocks, module)
            q, qt, a = (getattr(stored, attr + x).get_value() for x in ("", fp8_base.T, fp8_base.AMAX))
            assert q.dtype == qt.dtype == fp8.E4M3 and isinstance(getattr(stored, attr), fp8_base.Frozen)
            np.testing.assert_array_equal(np.asarray(qt), np.transpose(np.asarray(q), order))
            np.testing.assert_array_equal(np.asarray(a), np.abs(w).reshape(len(w), -1).max(axis=1))
            np.testing.assert_allclose(np.asarray(fp8_base.plain(stored, attr, F32)), w, rtol=0.07,
                                       atol=1e-3 * a.max())
        return per_step, at_rest

    def run(per_step, at_rest, s):
        # bit for bit with XLA's default CPU code generation (tests/conftest.py)
        (l0, (g0, h0)), (l1, (g1, h1)) = (loss_and_grads_as_users(*nnx.split(m), batch(s, b=8))
                                          for m in (per_step, at_rest))
        f0, f1 = flat(g0), flat(g1)
        assert f0.keys() == f1.keys()
        return float(l0), f0, h0, float(l1), f1, h1

    if "attn_chunk" in fields:
        _, at_rest = models(seed)
        per_step = build(dataclasses.replace(cfg, fp8=False), mesh, seed)  # the reference: no float8 at all
        l0, f0, _, l1, f1, _ = run(per_step, at_rest, seed)
        assert abs(l1 / l0 - 1) < 3e-3
        assert min(cosine(f1[k], f0[k]) for k in f0) > 0.95, {k: cosine(f1[k], f0[k]) for k in f0}
        return

    def compare(s):
        l0, f0, h0, l1, f1, h1 = run(*models(s), s)
        loss = abs(l1 / l0 - 1)
        assert loss < 1e-3, loss
        assert_float8_noise(f1, f0)
        new0, new1 = (flat(h0), flat(h1)) if recipe == "delayed" else ({}, {})
        exact = l0 == l1 and all(np.array_equal(f0[k], f1[k]) for k in f0) and all(
            np.array_equal(new0[k], new1[k]) for k in new0)
        return exact, {"loss": loss, **{k: max_rel(f1[k], f0[k]) for k in f0 if not np.array_equal(f0[k], f1[k])}}

    a_draw_flips_no_rounding(compare, seed)


@pytest.mark.slow  # 39 s on 2 cores
def test_lora_base_at_rest_in_delta_head_groups_is_the_whole_sublayer(seed):
    """LoRA + --fp8 on a hybrid, the base at rest in float8: the delta-net in head groups (``--delta-head-chunk``: each
    group takes its cut of both float8 copies, ``delta_net.cut_frozen``) against the whole sublayer. The weights'
    scales are the layer's in both; the output gradient's float8 scale is each group's own, so close, not equal
    (3 seeds: loss within 1.7e-4, each adapter gradient's cosine >= 0.989; held at 1e-3 and 0.97)."""
    lora_cfg = dataclasses.replace(LORA_ALL, targets="q,k,v,o,gate,up,down,in_proj_qkv,out_proj")
    cfg = dataclasses.replace(BASE, compute_dtype="float32", fp8=True, lora=lora_cfg,
                              **dict(HYBRID, linear_num_key_heads=8, linear_num_value_heads=16))
    mesh, b = make_mesh(fsdp=2, sp=4), batch(seed, b=8)
    (l0, (g0, _)), (l1, (g1, _)) = (loss_and_grads(*nnx.split(build(c, mesh, seed)), b)
                                    for c in (cfg, dataclasses.replace(cfg, delta_head_chunk=2)))
    f0, f1 = flat(g0), flat(g1)
    assert abs(float(l1) / float(l0) - 1) < 1e-3
    assert min(cosine(f1[k], f0[k]) for k in f0) > 0.97, {k: cosine(f1[k], f0[k]) for k in f0}


@pytest.mark.parametrize("groups", [False, pytest.param(True, marks=pytest.mark.slow)])  # 26 s: make test-slow
def test_a_hybrids_delta_net_runs_its_projections_in_float8(groups, seed):
    """A hybrid (a delta-net layer and an attention layer, head dims 32) with --fp8 on fsdp 2 x sp 4 beside the same
    model without. Over 400 seeds (6000-6399, whole sublayer; 2026-11-29): loss within 1.31e-3; each gradient's error
    within 0.302 of its norm or of 5% of the median gradient's norm, whichever is larger; the cosine of each gradient of
    at least 10% of that median >= 0.9538 (attn_norm's scale; wq 0.9585), of all together >= 0.9793. Held at 5e-3, 0.45,
    0.9 and 0.95: a gradient lost (error 1) or a float8 scale gone wrong is far outside. The floors are there because
    the gradients of A_log, dt_bias and the a projection (a sum over every token that nearly cancels: from 1e-5 to 9% of
    the median here) are small, and then float8's rounding of q, k and v is as large as they are: cosines of -0.9999
    (A_log), -0.9997 (dt_bias) and 0.8027 (wa). The bounds held before (a floor of 1% of the median, cosine 0.95 and all
    0.975, error 0.35, from 40 seeds) were crossed by seed 6026 (wa's cosine 0.894). In head groups (8 / 16 heads, 2
    value heads a group: each group its own scales; 13 seeds) cosines >= 0.9782. That the delta-net's GEMMs are float8
    at all is the compiled program's (next test)."""
    fields = dict(HYBRID, linear_num_key_heads=8, linear_num_value_heads=16, delta_head_chunk=2) if groups else HYBRID
    cfg = dataclasses.replace(BASE, compute_dtype="float32", fp8=True, **fields)
    mesh, b = make_mesh(fsdp=2, sp=4), batch(seed, b=8)
    (l8, (g8, _)), (l32, (g32, _)) = (loss_and_grads(*nnx.split(build(c, mesh, seed)), b)
                                      for c in (cfg, dataclasses.replace(cfg, fp8=False)))
    assert abs(float(l8) / float(l32) - 1) < 5e-3
    f8, f32 = flat(g8), flat(g32)
    norms = {k: float(np.linalg.norm(f32[k])) for k in f32}
    median = float(np.median(list(norms.values())))
    errors = {k: float(np.linalg.norm(f8[k] - f32[k])) / max(norms[k], 0.05 * median) for k in f32}
    assert max(errors.values()) < 0.45, errors
    cosines = {k: cosine(f8[k], f32[k]) for k in f32 if norms[k] >= 0.1 * median}
    # below the floor at some seed (400 seeds): A_log, dt_bias, wa, the delta-net's norm and the three norm scales
    assert len(cosines) >= len(f32) - 7 and min(cosines.values()) > 0.9, cosines
    assert cosine(np.concatenate([f8[k].ravel() for k in f32]), np.concatenate([f32[k].ravel() for k in f32])) > 0.95


@pytest.mark.aot
@pytest.mark.parametrize("lora_on", [False, pytest.param(True, marks=pytest.mark.slow)])  # 21 s: make test-slow
def test_the_h100_program_runs_the_delta_nets_projections_in_float8(lora_on):
    """One compile-only H100, a model of delta-net layers alone, bf16: the layer loop's float8 forward dots carry the
    FLOPs of q, k, v and z (one GEMM on their weights side by side), the output projection and the MLP, and not b and
    a's (a few columns into the gates: bf16); the backward's e5m2 dots twice those (dX and dW), or, with LoRA's frozen
    base (at rest in float8, ``fp8_base``), once (dX alone)."""
    from ulysses_jax.plan import hlo

    cfg = dataclasses.replace(BASE, hidden=256, num_layers=2, layer_pattern=("linear",), linear_num_key_heads=2,
                              linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                              mlp_dim=512, fp8=True, param_dtype="bfloat16",
                              lora=LoraConfig(rank=4, alpha=8.0, targets="in_proj_qkv") if lora_on else None)
    d, hk, hv, dk, dv = 256, 2, 4, 64, 64
    per_token = d * (2 * hk * dk + 2 * hv * dv) + hv * dv * d + 3 * d * 512
    dots = hlo.float8_dots(compiled_step_text(cfg, devices=1, fsdp=1, batch_size=1, seq_len=512))
    assert dots["f8e4m3fn x f8e4m3fn"]["flops"] == 2 * 512 * per_token
    assert sum(v["flops"] for k, v in dots.items() if "f8e5m2" in k) == (1 if lora_on else 2) * 2 * 512 * per_token


def trainer(cfg, mesh, steps=10, grad_accum=1, lr=3e-3):
    """``(graphdef, state, step)``: a fresh train state and its jitted step (AdamW, one warmup step, no decay)."""
    optim = OptimConfig(lr=lr, warmup_steps=1, weight_decay=0.0)
    tx = make_optimizer(optim, steps)
    graphdef, state = init_state(cfg, mesh, tx, seed=0)
    step = make_train_step(graphdef, tx, make_schedule(optim, steps), mesh, state_shardings(state),
                           grad_accum=grad_accum)
    return graphdef, state, step.lower(state, patterned(0, b=8)).compile(FAST)


def patterned(i, b=4, s=64):
    """Rows of arithmetic sequences mod V (random start, step 1-3): a language a small model learns in a few steps."""
    rng = np.random.default_rng(i)
    tokens = (rng.integers(0, V, (b, 1)) + rng.integers(1, 4, (b, 1)) * np.arange(s)[None]) % V
    tokens = jnp.asarray(tokens, jnp.int32)
    return dict(tokens=tokens, labels=shift_labels(tokens, None), segment_ids=jnp.ones_like(tokens),
                positions=jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), tokens.shape))


def test_ten_steps_learn_as_bf16_does():
    """The short training check (`make test-slow`, with the real entry point's 30-step run below): 10 steps of a
    2-layer model on one batch of a patterned language, float8 against bf16: the loss falls the same way (measured:
    5.56 -> 3.23 in bf16, -> 3.25 in float8), within 3% at the end."""
    finals, b = {}, patterned(0, b=8)
    for on in (False, True):
        _, state, step = trainer(dataclasses.replace(BASE, fp8=on), one_device(), lr=1e-2)
        losses = []
        for _ in range(10):
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        assert losses[-1] < 0.7 * losses[0]
        finals[on] = losses[-1]
    assert abs(finals[True] / finals[False] - 1) < 0.03


def test_delayed_history_through_the_step_accumulation_and_a_resume(tmp_path):
    """The train step stores each step's amaxes in the history (slot 0, the older ones shifted), the optimizer never
    touches it, micro-batches meet in a max, and a run restored from a checkpoint continues with the same losses as an
    uninterrupted one (the history is in the checkpoint)."""
    cfg, mesh = dataclasses.replace(BASE, fp8=True, fp8_recipe="delayed"), one_device()
    graphdef, state, step = trainer(cfg, mesh, steps=4, grad_accum=2)
    b0 = patterned(0, b=8)
    # the step's new history: the max over its two micro-batches (rows i % 2) of each one's new history
    micro = [jax.tree.map(lambda x: x[i::2], b0) for i in range(2)]
    want = fp8.combine(*(loss_and_grads(graphdef, state["params"], m)[1][1] for m in micro))
    ckpt = Checkpointer(tmp_path, async_save=False)
    losses = []
    for i in range(4):
        state, m = step(state, patterned(i, b=8))
        losses.append(float(m["loss"]))
        hist = flat(fp8.split(state["params"])[1])
        if i == 0:  # the same amaxes up to a bfloat16 rounding or two of a gradient (two programs); a sum: twice
            for k, h in flat(want).items():
                np.testing.assert_allclose(hist[k], h, rtol=2.0**-6)
        assert all((h[..., : i + 1] > 0).all() and (h[..., i + 1:] == 0).all() for h in hist.values())
        if i == 1:
            ckpt.save(2, state, {})
            ckpt.wait()
    _, abstract = abstract_state(cfg, mesh, make_optimizer(OptimConfig(lr=3e-3, warmup_steps=1, weight_decay=0.0), 4))
    restored, _ = ckpt.restore(2, abstract)
    assert all((h[..., :2] > 0).all() for h in flat(fp8.split(restored["params"])[1]).values())
    again = []
    for i in (2, 3):
        restored, m = step(restored, patterned(i, b=8))
        again.append(float(m["loss"]))
    assert again == losses[2:]
    ckpt.close()


@pytest.mark.parametrize("fields,message", [
    (dict(fp8=True, fp8_recipe="hybrid"), "fp8_recipe 'hybrid' is not a float8 scaling recipe; use --fp8-recipe"),
    (dict(fp8=True, num_experts=4, experts_per_token=2), "experts, whose grouped matmul kernel takes no float8"),
    (dict(fp8=True, fp8_recipe="delayed", offload_params=True), "use --fp8-recipe current with --offload-params"),
    (dict(fp8=1), r"fp8 \(1\) must be True or False"),
])
def test_refusals(fields, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BASE, **fields)


@pytest.mark.parametrize("args,message", [
    (["--fp8", "--fp8-recipe", "hybrid"], "fp8_recipe 'hybrid' is not a float8 scaling recipe"),
    (["--fp8-recipe", "delayed"], "--fp8-recipe delayed chooses the scales of float8 GEMMs, but --fp8 is not set"),
])
def test_the_cli_refuses_in_one_line(args, message, capsys, tmp_path):
    from ulysses_jax.cli import main

    assert main(["train", "--steps", "1", "--run-dir", str(tmp_path / "r"), *args]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_hugging_face_folder_starts_with_empty_histories(tmp_path):
    """``from_hf`` with delayed scaling: every weight from the folder, the histories (not in the folder) empty."""
    import test_cli_hf as hf_helpers  # the tiny Hugging Face folder (a module: not collected twice)

    from ulysses_jax.interop.hf import from_hf

    folder = hf_helpers.make_folder(tmp_path / "hf")
    plain = from_hf(folder, mesh=one_device(), compute_dtype="float32")
    model = from_hf(folder, mesh=one_device(), compute_dtype="float32", fp8=True, fp8_recipe="delayed")
    rest, hist = fp8.split(nnx.state(model, nnx.Param))
    assert all((h == 0).all() for h in flat(hist).values()) and len(flat(hist)) == 2
    want = flat(nnx.state(plain, nnx.Param))
    assert all(np.array_equal(v, want[k]) for k, v in flat(rest).items())


def test_a_lora_start_from_a_folder_rests_in_float8_and_merges_the_values_it_used(tmp_path):
    """``train --init-from-hf --lora-rank --fp8``'s model (``trainer._hf_weights``): the base's projections in float8
    at rest as a fresh model has them (the same graph), each layer quantised with its own amax; ``export --merge`` of
    it (``peft.merged``) writes the dequantised base (what every step computed with) plus the adapters' product, a
    plain float32 model of the folder's family that ``to_hf`` writes."""
    import test_cli_hf as hf_helpers  # the tiny Hugging Face folder (a module: not collected twice)

    from ulysses_jax.interop import hf, peft
    from ulysses_jax.train.config import TrainConfig, model_config
    from ulysses_jax.train.devices import MeshConfig, build_mesh
    from ulysses_jax.train.trainer import _hf_weights

    folder = hf_helpers.make_folder(tmp_path / "hf")
    cfg = TrainConfig(init_from_hf=str(folder), seq_len=32, attention="xla", mesh=MeshConfig(fsdp=2, sp=4),
                      lora_rank=4, lora_targets="q,down", param_dtype="float32", fp8=True)
    config = model_config(cfg, 0)
    mesh = build_mesh(cfg.mesh, config, cfg.seq_len)
    model = _hf_weights(str(folder), config, mesh, seed=0)
    fresh = nnx.eval_shape(lambda: Transformer(config, mesh=mesh, rngs=nnx.Rngs(0)))
    assert nnx.graphdef(model) == nnx.graphdef(fresh)
    source = flat(nnx.state(hf.from_hf(folder, mesh=mesh, compute_dtype=config.compute_dtype), nnx.Param))
    for module, attr in (("attn", "wq_DNH"), ("mlp", "w_up_DF")):
        stored = getattr(model.blocks, module)
        assert getattr(stored, attr).get_value().dtype == fp8.E4M3
        w = np.asarray(jnp.asarray(source[("blocks", module, attr)]).astype(config.compute_jnp_dtype), np.float32)
        np.testing.assert_array_equal(np.asarray(getattr(stored, attr + fp8_base.AMAX).get_value()),
                                      np.abs(w).reshape(len(w), -1).max(axis=1))  # of the compute dtype's values
    var = model.blocks.lora.w_down_b  # B random: the adapters change the weights
    var.set_value(var.get_value() + 0.05 * jax.random.normal(jax.random.key(1), var.get_value().shape))
    merged = peft.merged(model)
    up, down = merged.blocks.mlp.w_up_DF.get_value(), merged.blocks.mlp.w_down_FD.get_value()
    assert up.dtype == down.dtype == jnp.float32 and not hasattr(merged.blocks.mlp, "w_up_DF" + fp8_base.T)
    np.testing.assert_array_equal(np.asarray(up), np.asarray(fp8_base.plain(model.blocks.mlp, "w_up_DF", F32)))
    a, b = model.blocks.lora.w_down_a.get_value(), var.get_value()
    want = fp8_base.plain(model.blocks.mlp, "w_down_FD", F32) + lora.delta(a, b, 1, config.lora.scale)
    np.testing.assert_allclose(np.asarray(down), np.asarray(want), rtol=1e-6, atol=1e-7)
    hf.to_hf(merged, tmp_path / "merged")
    assert (tmp_path / "merged" / "config.json").is_file()


def test_plan_estimates_float8_gemms_at_their_own_rate():
    """The estimate's float8 matmuls (all but the unembedding) at FP8_MATMUL_RATE, both kinds at the measured
    MATMUL_EFFICIENCY, the rate labelled as fitted on measured rows."""
    from ulysses_jax.plan import estimate
    from ulysses_jax.plan.targets import TARGETS

    model = ModelConfig.from_preset("llama3.1-8b")
    p = types.SimpleNamespace(target=TARGETS["h100"], num_devices=8, batch_size=1, seq_len=32768, mesh={"sp": 8},
                              collectives={}, memory={}, breakdown={"optimizer": 0}, optimizer_on_host=False,
                              flops_per_device=1e15)
    bf16, f8 = (estimate.step_estimate(p, dataclasses.replace(model, fp8=on), "cudnn") for on in (False, True))
    tokens = p.seq_len / p.num_devices
    head = 3 * 2 * model.vocab_size * model.hidden * tokens
    eff = estimate.MATMUL_EFFICIENCY
    total = bf16["parts"]["matmul_s"] * estimate.MATMUL_RATE * eff
    want = head / (estimate.MATMUL_RATE * eff) + (total - head) / (estimate.FP8_MATMUL_RATE * eff)
    assert f8["parts"]["matmul_s"] == pytest.approx(want, rel=1e-9)
    assert f8["parts"]["matmul_fp8_s"] == pytest.approx((total - head) / (estimate.FP8_MATMUL_RATE * eff), rel=1e-9)
    assert bf16["parts"]["matmul_fp8_s"] == 0.0
    assert any("fitted on measured rows" in a and "--fp8" in a for a in f8["assumptions"])
    assert not any("--fp8" in a for a in bf16["assumptions"])


# ------------------------------------------------------------------------------------ the compiled H100 program


@pytest.mark.aot
def compiled_step_text(cfg, *, devices: int, fsdp: int, batch_size: int, seq_len: int) -> str:
    """The optimised HLO of ``cfg``'s training step on ``devices`` compile-only H100s (fsdp ``fsdp``)."""
    return compiled_step(cfg, devices=devices, fsdp=fsdp, batch_size=batch_size, seq_len=seq_len).as_text()


def compiled_step(cfg, *, devices: int, fsdp: int, batch_size: int, seq_len: int):
    """``cfg``'s training step compiled for ``devices`` compile-only H100s (fsdp ``fsdp``)."""
    from ulysses_jax.plan.targets import target_devices
    from ulysses_jax.train.program import step_program

    mesh = make_mesh(fsdp=fsdp, sp=1, devices=target_devices("h100", devices=devices))
    optim = OptimConfig(lr=1e-3, warmup_steps=0, weight_decay=0.0)
    tx = make_optimizer(optim, 10)
    graphdef, state = abstract_state(cfg, mesh, tx)
    step, b = step_program(graphdef, state, tx, optim, steps=10, mesh=mesh, batch_size=batch_size, seq_len=seq_len)
    return step.trace(state, b).lower().compile()


def test_the_h100_program_runs_every_projection_gemm_in_float8():
    """One compile-only H100, a 2-layer model in bf16: in the layer loop's forward body the float8 dots (e4m3 x e4m3)
    carry exactly the projections' FLOPs, in its backward body the dots with e5m2 gradients exactly twice those (dX
    and dW of each); no projection dot is left in bf16 (the rest: the unembedding's three)."""
    from ulysses_jax.model.flops import layer_matmul_params
    from ulysses_jax.plan import hlo
    from ulysses_jax.plan.targets import target_devices
    from ulysses_jax.train.program import step_program

    cfg = dataclasses.replace(BASE, hidden=256, num_heads=4, num_kv_heads=2, head_dim=64, mlp_dim=512,
                              attention_impl="cudnn", fp8=True)
    mesh = make_mesh(devices=target_devices("h100", devices=1))
    optim = OptimConfig(lr=1e-3, warmup_steps=0, weight_decay=0.0)
    tx = make_optimizer(optim, 10)
    graphdef, state = abstract_state(cfg, mesh, tx)
    step, b = step_program(graphdef, state, tx, optim, steps=10, mesh=mesh, batch_size=1, seq_len=1024)
    text = step.trace(state, b).lower().compile().as_text()
    dots = hlo.float8_dots(text)
    per_layer = 2 * 1024 * layer_matmul_params(cfg)
    assert dots["f8e4m3fn x f8e4m3fn"]["flops"] == per_layer
    assert sum(v["flops"] for k, v in dots.items() if "f8e5m2" in k) == 2 * per_layer
    assert "--fp8: 4 float8 forward dots" in hlo.float8_note(text)  # q, k, v merged by XLA; gate and up too
    comps, _ = hlo.parse(text)
    all_dots = sum(i.opcode == "dot" for ins in comps.values() for i in ins)
    assert all_dots - sum(v["dots"] for v in dots.values()) == 3  # the unembedding's forward, dX, dW (attention: cuDNN)
    json.dumps(dots)  # plain data, as plan's JSON carries it


@pytest.mark.aot
@pytest.mark.parametrize("gpus", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2 GPUs: 20 s more, make test-slow
def test_lora_base_at_rest_is_neither_cast_nor_transposed_in_the_step(gpus):
    """LoRA + --fp8 on compile-only H100s, the base in float8 at rest (``fp8_base``) against the same step quantising
    it every step (the path before it; ``applies`` patched off). On 2 GPUs (fsdp 2) with the tiled MLP (4 chunks):
    no fusion makes a float8 gate, up or down weight (before: 10 a step here, whatever the chunks; 384 for
    Llama-3.1-8B's LoRA at 8K), and no gather of one is bf16. On one GPU (the plain MLP; the tiled one measured the
    same): no fusion transposes a stacked parameter (before: all seven projections' stacks, in bf16, each step: the
    layouts Hopper's float8 GEMMs read) and the step's temporary memory is no more than the bf16 step's (before: 1.6x
    it here; +9.7 GiB for Llama-3.1-8B's LoRA at 8K)."""
    import re

    from ulysses_jax.model.lora_config import LoraConfig
    from ulysses_jax.plan import hlo

    d, f = 256, 768

    def step(chunk, at_rest, fp8_on=True, devices=2):
        cfg = dataclasses.replace(BASE, hidden=d, num_heads=4, num_kv_heads=2, head_dim=64, mlp_dim=f, num_layers=4,
                                  attention_impl="cudnn", fp8=fp8_on, mlp_chunk=chunk, remat="full",
                                  param_dtype="bfloat16", lora=LoraConfig(rank=4, alpha=8.0, targets="q,v"))
        with mock.patch.object(fp8_base, "applies", lambda c: at_rest):
            return compiled_step(cfg, devices=devices, fsdp=devices, batch_size=devices, seq_len=512)

    def weight_casts(text):
        count, bf16_gathers = 0, 0
        for i, times in hlo.executed(text):
            for dtype, dims in re.findall(r"(f8e4m3fn|bf16)\[([\d,]*)\]", i.type):
                whole = sorted(int(x) for x in dims.split(",") if x and int(x) > 1) == sorted((d, f))
                count += times * (whole and dtype == "f8e4m3fn" and i.opcode == "fusion")
                bf16_gathers += whole and dtype == "bf16" and i.opcode.startswith("all-gather")
        return count, bf16_gathers

    if gpus == 2:
        assert weight_casts(step(128, at_rest=True).as_text()) == (0, 0)
        assert weight_casts(step(128, at_rest=False).as_text())[0] > 0  # what the count finds when there are some
        return
    for chunk in (0,):
        programs = [step(chunk, at_rest, fp8_on, devices=1) for at_rest, fp8_on in ((True, True), (False, True),
                                                                                    (False, False))]
        copies = [hlo.parameter_copies(c.as_text()) for c in programs]
        temp = [c.memory_analysis().temp_size_in_bytes for c in programs]
        assert copies[0] == copies[2] == [] and hlo.parameter_copies_note(programs[0].as_text()) is None, copies
        assert {n for n, _ in copies[1]} == {f"blocks.{m}.{a}" for m, ws in fp8_base.WEIGHTS.items() if m != "delta"
                                             for a, _ in ws}, copies  # all seven, in bf16: twice float8's bytes
        # 4 layers of bf16: q and o (4 heads of 64), k and v (2 heads), gate, up and down
        assert sum(b for _, b in copies[1]) == 2 * 4 * (2 * d * 4 * 64 + 2 * d * 2 * 64 + 3 * d * f)
        assert "XLA copies 7 parameters whole into another layout" in hlo.parameter_copies_note(programs[1].as_text())
        assert temp[0] <= temp[2] < temp[1], temp


@pytest.mark.aot
@pytest.mark.parametrize("mlp_chunk", [0, pytest.param(256, marks=pytest.mark.slow)])  # 27 s: make test-slow
def test_fsdp_gathers_the_projection_weights_in_float8(mlp_chunk):
    """Two compile-only H100s, fsdp 2, a model whose gathered bytes are the projections' weights but for the norms and
    the embeddings: with --fp8 its bf16 all-gathers become float8 ones, under 0.55 of their bytes (the weights
    quantised where they rest, gathered in float8; the embeddings bf16 and the float32 ones as before); the tiled MLP
    too (``mlp_chunk``: its trained weights' gradients reach them through ``fp8.grad_carrier``)."""
    import math
    import re


    size = {"f8e4m3fn": 1, "bf16": 2, "f32": 4}

    def gathered(fp8_on):
        """``{dtype: bytes}`` of the all-gathers' operands and results in the compiled step."""
        cfg = dataclasses.replace(BASE, hidden=256, num_heads=4, num_kv_heads=2, head_dim=64, mlp_dim=1024,
                                  vocab_size=256, attention_impl="cudnn", fp8=fp8_on, mlp_chunk=mlp_chunk)
        text = compiled_step_text(cfg, devices=2, fsdp=2, batch_size=2, seq_len=1024)
        out = dict.fromkeys(size, 0)
        shape = re.compile(r"(f8e4m3fn|bf16|f32)\[([\d,]*)\]")
        for line in text.splitlines():
            if "all-gather-start" in line and " = " in line:
                for dtype, dims in shape.findall(line.split(" = ")[1].split(" all-")[0]):  # the op's types
                    out[dtype] += size[dtype] * math.prod(int(d) for d in dims.split(",") if d)
        return out

    on, off = gathered(True), gathered(False)
    assert off["f8e4m3fn"] == 0 and on["f8e4m3fn"] > 0, (on, off)
    assert on["f32"] == off["f32"] and on["f8e4m3fn"] + on["bf16"] < 0.55 * off["bf16"], (on, off)  # measured 0.53


# ------------------------------------------------------------------------------------ the real entry point (slow)

TINY = ["--preset", "tiny", "--seq-len", "128", "--attention", "xla", "--no-progress", "--mesh.fsdp", "2",
        "--mesh.sp", "4", "--batch-size", "2"]


def losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_thirty_steps_of_the_tiny_preset_learn_as_without(tmp_path, capsys):
    """`ulysses-jax train` (in process), 30 steps of the tiny preset on the built-in corpus, with and without --fp8 (the
    preset computes in float32): the last five steps' mean loss within 3%."""
    from ulysses_jax.cli import main

    means = {}
    for flags in ([], ["--fp8"]):
        run = tmp_path / ("fp8" if flags else "plain")
        assert main(["train", *TINY, "--steps", "30", "--run-dir", str(run), *flags]) == 0
        got = losses(run)
        means[bool(flags)] = float(np.mean([got[s] for s in range(26, 31)]))
        assert means[bool(flags)] < 0.9 * got[1]
    assert "Float8: float8 GEMMs for q, k, v, o, gate, up, down" in capsys.readouterr().out
    assert abs(means[True] / means[False] - 1) < 0.03


@pytest.mark.slow
def test_train_resume_with_delayed_scaling_is_exact(tmp_path, capsys):
    """--fp8-recipe delayed through `train`: the last checkpoint lost, `--resume` recomputes the steps after the one
    left with the uninterrupted run's losses, bit for bit (the history came back from the checkpoint); eval reads it."""
    import shutil

    from ulysses_jax.cli import main

    run = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "4", "--checkpoint-every", "2", "--grad-accum", "2", "--batch-size", "4",
                 "--fp8", "--fp8-recipe", "delayed", "--run-dir", str(run)]) == 0
    want = losses(run)
    record = json.loads((run / "run.json").read_text())
    assert record["model"]["fp8"] is True and record["model"]["fp8_recipe"] == "delayed"
    shutil.rmtree(run / "checkpoints" / "4")
    assert main(["train", "--run-dir", str(run), "--resume"]) == 0
    assert losses(run) == want
    assert main(["train", "--run-dir", str(run), "--resume", "--steps", "5", "--fp8-recipe", "current"]) != 0
    assert "fp8_recipe is 'current' here but 'delayed' in the run" in capsys.readouterr().err
    assert main(["eval", "--run-dir", str(run), "--max-batches", "1"]) == 0


@pytest.mark.aot
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_cublaslt_float8_gemms_write_bf16_on_h100(frozen):
    """A bf16 float8 projection, forward and backward, compiled for a compile-only H100 with XLA's Triton GEMMs off
    (the GEMMs the H200 of 2026-11-28 ran were cuBLASLt's): every GEMM is cuBLASLt's float8 one and writes bf16, its
    rescale folded in (``fp8._dot_to``; before, each wrote float32 and a pass of its own cast it). ``frozen``: LoRA's
    base (``frozen_einsum``), its dX alone."""
    from ulysses_jax.plan.targets import target_devices

    sh = jax.sharding.SingleDeviceSharding(target_devices("h100", devices=1)[0])
    x = jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16, sharding=sh)
    w = jax.ShapeDtypeStruct((1024, 3072), jnp.bfloat16, sharding=sh)

    def loss(x, w):
        if frozen:
            return fp8.frozen_einsum("td,df->tf", x, fp8.prequantize(w)).astype(F32).sum()
        return fp8.fp8_einsum("td,df->tf", x, w).astype(F32).sum()

    with jax.default_device(sh.device_set.pop()):
        step = jax.jit(jax.value_and_grad(loss, (0,) if frozen else (0, 1)))
        text = step.trace(x, w).lower().compile({"xla_gpu_enable_triton_gemm": False}).as_text()
    import re

    gemms = re.findall(r'= \(?(\w+)\[[\d,]*\][^=]*custom_call_target="(__cublas[^"]*)"', text)
    assert gemms == [("bf16", "__cublas$lt$matmul$f8")] * (2 if frozen else 3), gemms
