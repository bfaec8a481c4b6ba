"""next_token_loss: the token-weighted mean over the global batch (never a mean of shard means), empty shards
and rows, gradient accumulation by tokens, and the tiled loss equal to the plain one without its logits."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_model import (
    FAST_COMPILE,
    VARIANTS,
    S,
    V,
    assert_gathers_only_parameters,
    assert_same,
    build,
    forward,
    packed_batch,
    rel_err,
    run_model,
)

from ulysses_jax import IGNORE, next_token_loss, shift_labels


def token_losses(logits, labels):
    """float64 NumPy: -log softmax(logits)[label] per token (``inf`` where the label is ignored)."""
    logits, labels = np.asarray(logits, np.float64), np.asarray(labels)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, np.maximum(labels, 0)[..., None], -1)[..., 0]
    return np.where(labels >= 0, nll, np.inf)


def reference_loss(logits, labels):
    """float64 NumPy: (mean, sum, count) of -log softmax(logits)[label] over labels >= 0."""
    nll = token_losses(logits, labels)
    valid = np.isfinite(nll)
    total, count = float(np.where(valid, nll, 0).sum()), int(valid.sum())
    return total / max(count, 1), total, count


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
def loss_and_grads(graphdef, state, batch):
    def f(state):
        out = next_token_loss(nnx.merge(graphdef, state), batch)
        return out.sum, out

    (_, out), grads_of_sum = jax.value_and_grad(f, has_aux=True)(state)
    return out, grads_of_sum


def test_shift_labels_before_the_split():
    tokens = jnp.asarray([[10, 11, 12, 13, 14, 15, 16, 17]])
    seg = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 2]])
    np.testing.assert_array_equal(shift_labels(tokens), [[11, 12, 13, 14, 15, 16, 17, IGNORE]])
    # the last token of each document has no target; with sp=4 positions 1, 3, 5 end a shard yet keep theirs
    np.testing.assert_array_equal(shift_labels(tokens, seg), [[11, 12, IGNORE, 14, 15, 16, IGNORE, IGNORE]])


def test_plain_loss_matches_reference(seed):
    """Against float64 NumPy on the model's own logits, with ignored labels (-1 and -100) and packing."""
    model = build(VARIANTS["gqa-llama3"](), "fsdp2xsp4", seed)
    batch = packed_batch(seed, shard=S // 4)
    rng = np.random.default_rng(seed)
    labels = np.asarray(batch["labels"])
    labels = np.where(rng.random(labels.shape) < 0.2, rng.choice([-1, -100], labels.shape), labels)
    batch["labels"] = jnp.asarray(labels)
    out, _ = loss_and_grads(*nnx.split(model), batch)
    logits = forward(model, batch["tokens"], segment_ids=batch["segment_ids"])
    want_loss, want_sum, want_count = reference_loss(logits, labels)
    assert int(out.count) == want_count and out.count.dtype == jnp.int32
    np.testing.assert_allclose(float(out.sum), want_sum, rtol=1e-5)
    np.testing.assert_allclose(float(out.loss), want_loss, rtol=1e-5)


@pytest.mark.parametrize("mesh_name, variant", [("sp4", "gqa-llama3"), ("data2xfsdp2xsp2-zero3", "gqa-qknorm")])
def test_tiled_loss_equals_plain(mesh_name, variant, seed):
    """Value and gradients (tied head on sp4; untied head with ZeRO-3 over data x fsdp x sp)."""
    cfg = VARIANTS[variant]()
    batch = packed_batch(seed)
    plain = run_model(build(cfg, mesh_name, seed), batch)
    tiled = run_model(build(dataclasses.replace(cfg, loss_chunk=4), mesh_name, seed), batch)
    assert_same(tiled, plain)


@pytest.mark.parametrize("loss_chunk", [0, 8], ids=["plain", "tiled"])
def test_shards_and_rows_without_valid_tokens(loss_chunk, seed):
    """A sequence shard of every row and the whole of row 0 have no valid label: they add nothing (no NaN);
    with no valid label at all the loss is 0 with zero gradients."""
    cfg = dataclasses.replace(VARIANTS["gqa-llama3"](), loss_chunk=loss_chunk)
    model = build(cfg, "fsdp2xsp4", seed)
    graphdef, state = nnx.split(model)
    batch = packed_batch(seed)
    labels = np.asarray(batch["labels"]).copy()
    labels[:, S // 4 : S // 2] = IGNORE  # the second of four sequence shards
    labels[0] = IGNORE
    batch["labels"] = jnp.asarray(labels)
    out, grads = loss_and_grads(graphdef, state, batch)
    logits = forward(model, batch["tokens"], segment_ids=batch["segment_ids"])
    want_loss, _, want_count = reference_loss(logits, labels)
    assert int(out.count) == want_count
    np.testing.assert_allclose(float(out.loss), want_loss, rtol=1e-5)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))

    batch["labels"] = jnp.full_like(batch["labels"], IGNORE)
    out, grads = loss_and_grads(graphdef, state, batch)
    assert int(out.count) == 0 and float(out.loss) == 0.0 and float(out.sum) == 0.0
    assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(grads))


def test_gradient_accumulation_normalises_by_tokens(seed):
    """Two micro-batches with very different valid-token counts: summing the micro-batches' ``sum`` (and
    its gradient) and dividing by their added ``count`` gives the whole batch's loss and gradient. The second keeps
    each row's 8 labels of lowest loss, so that the two micro-batches' mean losses differ and averaging their means (the
    wrong normalisation) is far off: 0.25 over 6 seeds (with the first 8 labels kept, 4.5e-4 in one suite run)."""
    model = build(VARIANTS["gqa-qknorm"](), "sp4", seed)
    graphdef, state = nnx.split(model)
    batch = packed_batch(seed)
    labels = np.asarray(batch["labels"]).copy()
    nll = token_losses(forward(model, batch["tokens"], segment_ids=batch["segment_ids"]), labels)
    for r in range(4, len(labels)):  # the second half of the batch keeps 8 labels per row, its easiest
        labels[r, np.argsort(nll[r])[8:]] = IGNORE
    batch["labels"] = jnp.asarray(labels)
    whole, whole_grads = loss_and_grads(graphdef, state, batch)
    micro = [loss_and_grads(graphdef, state, {k: v[i : i + 4] for k, v in batch.items()}) for i in (0, 4)]
    total, count = sum(float(m.sum) for m, _ in micro), sum(int(m.count) for m, _ in micro)
    assert count == int(whole.count)
    np.testing.assert_allclose(total / count, float(whole.loss), rtol=1e-5)
    mean_of_means = np.mean([float(m.loss) for m, _ in micro])
    assert abs(mean_of_means - float(whole.loss)) > 1e-2  # the wrong normalisation would show
    accumulated = jax.tree.map(lambda a, b: (np.asarray(a) + np.asarray(b)) / count, micro[0][1], micro[1][1])
    for g, w in zip(jax.tree.leaves(accumulated), jax.tree.leaves(whole_grads), strict=True):
        assert rel_err(g, np.asarray(w) / count) < 1e-4


def test_tiled_loss_never_materialises_the_logits(seed):
    """The compiled tiled step holds no per-device ``[b, S/sp, V]`` float32 buffer (the plain one does),
    and all-gathers parameters only, never activations."""
    cfg = VARIANTS["gqa-llama3"]()
    batch = packed_batch(seed)
    local_logits = f"f32[{8 // 2},{S // 4},{V}]"  # fsdp2 x sp4: local batch 4, local sequence 16

    def hlo(cfg):
        model = build(cfg, "fsdp2xsp4", seed)
        return model, loss_and_grads.lower(*nnx.split(model), batch).compile().as_text()

    _, plain = hlo(cfg)
    assert local_logits in plain
    model, tiled = hlo(dataclasses.replace(cfg, loss_chunk=4))
    assert local_logits not in tiled
    assert f"f32[{8 // 2},4,{V}]" in tiled  # one chunk's logits
    assert_gathers_only_parameters(tiled, model)


def test_invalid_inputs():
    model = build(dataclasses.replace(VARIANTS["gqa-llama3"](), loss_chunk=5), "sp4", 0, perturb=False)
    batch = packed_batch(0)
    hidden = jnp.zeros((8, S, model.config.hidden))
    with pytest.raises(ValueError, match=r"loss_chunk \(5\) must divide the per-device sequence length \(16 = "):
        next_token_loss(model, batch, hidden=hidden)
    with pytest.raises(ValueError, match=r"labels shape \(8, 63\) must equal the tokens' \(8, 64\)"):
        next_token_loss(model, {**batch, "labels": batch["labels"][:, 1:]}, hidden=hidden)


def test_wide_dot_backward_runs_on_the_operands_dtype(seed):
    """``layers.wide_dot`` (the logits' product): float32 logits; its gradients those of autodiff's float32-cotangent
    product to bf16 rounding (the cotangent rounded to bf16 first: 1e-2 of the largest), in the operands' dtype; for
    float32 and float16 operands exactly autodiff's (float16, a mean's small cotangent: rounded to float16 first, its
    terms would flush to zero)."""
    from ulysses_jax.model.layers import wide_dot

    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    labels = jax.random.randint(k3, (2, 64), 0, 100)

    def grads(dot, dtype, scale=1.0):
        h, w = jax.random.normal(k1, (2, 64, 32), dtype), jax.random.normal(k2, (100, 32), dtype)

        def loss(h, w):
            logits = dot(h, w)
            assert logits.dtype == jnp.float32
            nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
            return scale * jnp.sum(nll)

        return jax.value_and_grad(loss, (0, 1))(h, w)

    ours = functools.partial(wide_dot, "bsd,vd->bsv")
    plain = functools.partial(jnp.einsum, "bsd,vd->bsv", preferred_element_type=jnp.float32)
    (l1, g1), (l0, g0) = grads(ours, jnp.bfloat16), grads(plain, jnp.bfloat16)
    assert l1 == l0 and [g.dtype for g in g1] == [jnp.bfloat16] * 2
    for a, b in zip(g1, g0):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 1e-2 * np.abs(b).max()
    (l1, g1), (l0, g0) = grads(ours, jnp.float32), grads(plain, jnp.float32)
    assert l1 == l0 and all(np.array_equal(a, b) for a, b in zip(g1, g0))
    (l1, g1), (l0, g0) = grads(ours, jnp.float16, 2.0**-20), grads(plain, jnp.float16, 2.0**-20)  # a mean's scale
    assert l1 == l0 and all(np.array_equal(a, b) and np.any(a != 0) for a, b in zip(g1, g0))


@pytest.mark.aot
@pytest.mark.parametrize("frozen", [False, True], ids=["trained-unembedding", "frozen-unembedding"])
def test_tiled_loss_backward_has_no_float32_gemm_on_h100(frozen):
    """The tiled loss's gradient compiled for a compile-only H100 with bf16 hidden states and unembedding: every GEMM
    (cuBLAS or XLA's Triton GEMM fusion) takes bf16 operands (before, the two backward GEMMs of each chunk took float32
    operands: TF32, 119 of 1,178 ms of llama3.2-1b's 32K step on an H200), and the program holds three GEMMs, the
    logits and their two gradients, each once in the one loop over chunks (before: four, the backward loop computing
    the logits again); two where the unembedding is frozen (LoRA: no gradient of it is computed)."""
    import re

    from ulysses_jax.model.loss import tiled_cross_entropy_sum
    from ulysses_jax.parallel.mesh import make_mesh
    from ulysses_jax.plan.targets import target_devices

    dev = target_devices("h100", devices=1)
    mesh = make_mesh(fsdp=1, sp=1, devices=dev)
    sh = jax.sharding.SingleDeviceSharding(dev[0])
    h = jax.ShapeDtypeStruct((1, 4096, 256), jnp.bfloat16, sharding=sh)
    w = jax.ShapeDtypeStruct((2048, 256), jnp.bfloat16, sharding=sh)
    labels = jax.ShapeDtypeStruct((1, 4096), jnp.int32, sharding=sh)

    def loss(h, w, labels):
        return tiled_cross_entropy_sum(h, w, labels, mesh=mesh, chunk=1024)[0]

    with jax.default_device(dev[0]):
        step = jax.value_and_grad(loss, (0,) if frozen else (0, 1))  # the value too, as the training step
        text = jax.jit(step).trace(h, w, labels).lower().compile().as_text()
    assert "gemm_fusion" in text or "__cublas" in text  # compiled for the GPU
    # every dot (inside XLA's GEMM fusions) and every cuBLAS call: operand types looked up by name
    types = dict(re.findall(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[", text, re.M))
    gemms = re.findall(r"= \w+\[[^\]]*\][^ ]* (?:dot|custom-call)\(([^)]*)\)(.*)$", text, re.M)
    gemms = [ops for ops, rest in gemms if "__cublas" in rest or "custom-call" not in rest]
    assert len(gemms) == (2 if frozen else 3), text
    operand_types = [[types[o.strip().lstrip("%")] for o in ops.split(",")] for ops in gemms]
    assert all(t == ["bf16", "bf16"] for t in operand_types), operand_types
    assert text.count(" while(") == 1  # one loop over the chunks


def test_fused_loss_sums_the_unembedding_gradient_in_float32(seed):
    """The tiled loss's unembedding gradient over 64 chunks of bf16 operands: within one bf16 rounding (2^-8) of the
    float64 gradient of the same operands, as for one chunk; summed in bf16 chunk by chunk it drifted with the chunks
    (relative 9e-3 at 64 chunks, 2e-2 at 256: a million tokens in chunks of 4096)."""
    from ulysses_jax.model.loss import fused_cross_entropy_sum

    n, c, d, v = 64, 64, 64, 512
    k = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(k[0], (n, 1, c, d)).astype(jnp.bfloat16)
    w = (0.3 * jax.random.normal(k[1], (v, d))).astype(jnp.bfloat16)
    labels = jax.random.randint(k[2], (n, 1, c), -1, v)  # some ignored (-1)
    dw = jax.grad(fused_cross_entropy_sum, argnums=1)(h, w, labels)
    assert dw.dtype == jnp.bfloat16
    h64, w64, lab = np.asarray(h, np.float64).reshape(-1, d), np.asarray(w, np.float64), np.asarray(labels).ravel()
    logits = h64 @ w64.T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    p[np.arange(len(lab)), np.maximum(lab, 0)] -= 1.0
    p[lab < 0] = 0.0
    assert rel_err(dw, p.T @ h64) <= 2.0**-8


def test_one_pass_logsumexp_equals_the_float64_one(seed):
    """``one_pass_logsumexp`` (one reduction of (maximum, sum) pairs) against NumPy's float64 log-sum-exp: rows of
    logits spread over +-60 (a vocabulary not a power of two), equal logits, one logit far above the rest, and rows
    near float32's lowest; within 2e-6 of each row's magnitude. A row of -inf gives -inf, a +inf logit NaN, never a
    finite loss. Its gradient (a rule of its own) is the softmax, as ``jax.nn.logsumexp``'s."""
    from ulysses_jax.model.loss import one_pass_logsumexp

    x = 20.0 * jax.random.normal(jax.random.key(seed), (4, 3, 5003))
    x = x.at[0, 0].set(7.0).at[0, 1, 17].set(1e4).at[1, 0].set(-3e38).at[1, 1, :5].set(-1e30)
    x64 = np.asarray(x, np.float64)
    m = x64.max(-1, keepdims=True)
    want = (m + np.log(np.exp(x64 - m).sum(-1, keepdims=True)))[..., 0]
    got = np.asarray(jax.jit(one_pass_logsumexp)(x), np.float64)
    assert np.all(np.abs(got - want) <= 2e-6 * np.maximum(np.abs(want), 1.0)), np.abs(got - want).max()
    assert got[0, 0] == pytest.approx(7.0 + np.log(5003), abs=1e-5) and got[0, 1] == 1e4
    assert np.isnan(one_pass_logsumexp(x.at[2, 2, 3].set(jnp.inf))[2, 2])
    assert one_pass_logsumexp(jnp.full((1, 9), -jnp.inf))[0] == -jnp.inf
    y = x[2:, :, :500] / 7  # rows without the extremes, whose softmax is a one-hot
    c = jax.random.normal(jax.random.key(seed + 1), y.shape[:-1])
    got_g = jax.grad(lambda y: jnp.sum(c * one_pass_logsumexp(y)))(y)
    want_g = jax.grad(lambda y: jnp.sum(c * jax.nn.logsumexp(y, axis=-1)))(y)
    np.testing.assert_allclose(got_g, want_g, atol=1e-6 * np.abs(want_g).max(), rtol=1e-5)


@pytest.mark.aot
def test_the_fused_loss_reads_each_chunks_logits_once_for_its_log_sum_exp():
    """The tiled loss's chunk compiled for a compile-only H100 (its gradients, as training runs it): the float32
    logits [c, V] are read whole by two kernels: one reduction for the log-sum-exp (maximum and sum in one pass;
    ``jax.nn.logsumexp``'s two reductions each read them) and the pass that writes the logits' gradient; the label's
    logit is a gather, fused into that pass or apart (plan.traffic counts its elements). The kernels reading
    them move 2.5 times their bytes (two reads and the bfloat16 gradient's write; with the two reductions, 3.5)."""
    from ulysses_jax.model.loss import fused_cross_entropy_sum
    from ulysses_jax.plan import hlo, traffic
    from ulysses_jax.plan.targets import target_devices

    n, c, d, v = 2, 512, 256, 32000
    h = jax.ShapeDtypeStruct((n, 1, c, d), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((v, d), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((n, 1, c), jnp.int32)
    with jax.default_device(target_devices("h100", devices=1)[0]):
        step = jax.jit(jax.grad(fused_cross_entropy_sum, argnums=(0, 1)))
        text = step.trace(h, w, labels).lower().compile().as_text()
    comps, _ = hlo.parse(text)
    instrs = {i.name: i for body in comps.values() for i in body}
    logits = [i for i in instrs.values()  # the GEMM kernel (a fusion around the dot, or cuBLAS' call), not its dot
              if i.type.startswith(f"f32[{c},{v}]") and i.opcode != "dot" and traffic.is_gemm(i, comps)]
    assert len(logits) == 1, [i.type for i in logits]
    readers = [i for i in instrs.values() if logits[0].name in i.operands]
    bodies = [" ".join(j.opcode for j in comps[re.search(r"calls=%([\w.\-]+)", r.attrs).group(1)]) for r in readers]
    assert sum("reduce" in b and "gather" not in b for b in bodies) == 1, bodies
    assert len(readers) <= 3, bodies  # the gather apart, or fused into the gradient's pass
    moved = sum(traffic.moved_bytes(r, comps, instrs) for r in readers) / (c * v * 4)
    assert 2.3 < moved < 2.7, moved  # in the logits' bytes
