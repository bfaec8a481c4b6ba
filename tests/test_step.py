"""The training step, optimizer-state layout, gradient accumulation and checkpoint reshard."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import USERS_CPU_CODEGEN
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ulysses_jax import make_mesh
from ulysses_jax.model.config import ModelConfig
from ulysses_jax.model.loss import shift_labels
from ulysses_jax.train import optimizer
from ulysses_jax.train.checkpoint import Checkpointer
from ulysses_jax.train.step import (
    OptimConfig,
    _loss_sums,
    abstract_state,
    accumulate,
    init_state,
    make_optimizer,
    make_schedule,
    make_train_step,
    state_shardings,
    zero_sums,
)

CFG = dataclasses.replace(ModelConfig.from_preset("tiny"), num_layers=1, compute_dtype="float32")
SEQ = 32


def random_batch(seed, rows, seq=SEQ, vocab=CFG.vocab_size):
    """Packed rows of 1-3 documents; labels shifted before any split; some rows with few valid labels."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (rows, seq), dtype=np.int32)
    seg = np.sort(rng.integers(1, 4, (rows, seq)), axis=1).astype(np.int32)
    positions = np.zeros_like(seg)
    for r in range(rows):
        for t in range(1, seq):
            positions[r, t] = positions[r, t - 1] + 1 if seg[r, t] == seg[r, t - 1] else 0
    labels = np.array(shift_labels(jnp.asarray(tokens), jnp.asarray(seg)))
    labels[0, 3:] = -1  # row 0 nearly empty: token weighting matters
    return {"tokens": tokens, "labels": labels, "segment_ids": seg, "positions": positions}


def fresh(mesh, tx):
    return init_state(CFG, mesh, tx, seed=0)


def test_optimizer_state_sharded_like_params():
    mesh = make_mesh(fsdp=2, sp=4)
    tx = make_optimizer(OptimConfig(), 10)
    _, state = fresh(mesh, tx)
    p_specs = {tuple(x.shape): x.sharding.spec for x in jax.tree.leaves(state["params"])}
    for leaf in jax.tree.leaves(state["opt_state"]):
        if leaf.ndim:  # mu, nu: same layout as their parameter
            assert leaf.sharding.spec == p_specs[tuple(leaf.shape)]
            assert any(ax for ax in leaf.sharding.spec)  # split, not replicated


def test_schedule_warmup_then_cosine():
    sched = make_schedule(OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1), 100)
    assert float(sched(0)) == 0.0 and float(sched(10)) == pytest.approx(1.0)
    assert float(sched(100)) == pytest.approx(0.1) and float(sched(50)) < 1.0
    assert float(sched(150)) == pytest.approx(0.1)  # past the decay: the minimum, never a restart
    default = OptimConfig().resolved(200)
    assert default.decay_steps == 200 and default.warmup_steps == 20  # 10% of the decay


@pytest.mark.parametrize("start", [5, 40, 99, 120])
def test_replanned_decay_never_jumps(start):
    """--optim.decay-steps on resume: from `start` on, a cosine from the rate there to the minimum at the new end."""
    cfg = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    before = make_schedule(cfg, 100)
    after = make_schedule(cfg, 100, ((start, 300),))
    steps = np.arange(0, 400)
    a, b = np.array([float(before(s)) for s in steps]), np.array([float(after(s)) for s in steps])
    np.testing.assert_array_equal(a[:start], b[:start])  # the past is unchanged
    assert b[start] == pytest.approx(a[start], abs=1e-6)  # no jump where it changes
    assert np.all(np.abs(np.diff(b[start:])) <= max(np.abs(np.diff(a)).max(), 1e-6) + 1e-6)
    assert b[300] == pytest.approx(0.1) and b[399] == pytest.approx(0.1)


@pytest.mark.parametrize("mesh_kw", [dict(fsdp=2, sp=4), dict(data=2, fsdp=2, sp=2)],
                         ids=["fsdp2xsp4", "dp2xfsdp2xsp2"])
def test_grad_accumulation_equals_large_batch(mesh_kw, seed):
    mesh = make_mesh(**mesh_kw)
    tx = optax.sgd(1.0)  # new params = params - grads: compares the gradients themselves
    batch = random_batch(seed, rows=8)
    results = []
    batch_devices = mesh.shape["data"] * mesh.shape["fsdp"]
    for accum in [a for a in (1, 2, 4) if 8 // a % batch_devices == 0]:
        graphdef, state = fresh(mesh, tx)
        step = make_train_step(graphdef, tx, make_schedule(OptimConfig(), 10), mesh, state_shardings(state),
                               grad_accum=accum)
        new_state, metrics = step(state, batch)
        results.append((metrics, jax.tree.leaves(new_state["params"])))
    (m1, p1) = results[0]
    assert int(m1["tokens"]) == int((batch["labels"] >= 0).sum())
    for m, p in results[1:]:
        np.testing.assert_allclose(float(m["loss"]), float(m1["loss"]), rtol=1e-6)
        np.testing.assert_allclose(float(m["grad_norm"]), float(m1["grad_norm"]), rtol=1e-5)
        for a, b in zip(p, p1):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_grad_accumulation_adds_in_float32(seed):
    """bfloat16 parameters: the micro-batches' gradients are added in float32. (1) Known bfloat16 gradients whose
    float32 sum is exact: the sum equals the float64 one (bfloat16 sums are off by up to 2**-9 of the total);
    (2) the model's gradient of 4 micro-batches against the float32 model's gradient of the whole batch."""
    mesh = make_mesh(fsdp=2, sp=4)
    cfg = dataclasses.replace(CFG, param_dtype="bfloat16")
    graphdef, state = init_state(cfg, mesh, optax.sgd(1.0), seed=0)
    params, accum = state["params"], 4
    rng = np.random.default_rng(seed)
    batch = random_batch(seed, rows=8)

    # (1) micro-batch m's gradient of every parameter: bfloat16 values spanning 2**-8..2**8 (exact sums in float32)
    values = rng.choice([1, -1], accum) * 2.0 ** rng.integers(-8, 9, accum) * (1 + rng.integers(0, 128, accum) / 128)
    batch["m"] = np.repeat(np.arange(8) % accum, SEQ).reshape(8, SEQ).astype(np.int32)
    known = jnp.asarray(values, jnp.bfloat16)

    def grad_known(p, micro, i):
        g = known[micro["m"][0, 0]]
        return (jnp.float32(0), zero_sums(0)), jax.tree.map(lambda x: jnp.full(x.shape, g, x.dtype), p)

    _, grads = jax.jit(lambda p, b: accumulate(grad_known, p, b, accum, mesh))(params, batch)
    want = np.asarray(known, np.float64).sum()
    for g in jax.tree.leaves(grads):
        assert g.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(g), np.float32(want))
    del batch["m"]

    # (2) the model: each micro-batch's gradient is bfloat16 (the parameters'), their sum float32
    grad_of = jax.value_and_grad(lambda p, b: _loss_sums(graphdef, p, b), has_aux=True)
    (total, sums), grads = jax.jit(lambda p, b: accumulate(lambda p, m, i: grad_of(p, m), p, b, accum, mesh))(
        params, batch)
    f32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    graphdef32 = init_state(CFG, mesh, optax.sgd(1.0), seed=0)[0]
    (total32, sums32), ref = jax.jit(jax.value_and_grad(lambda p, b: _loss_sums(graphdef32, p, b), has_aux=True))(
        f32, batch)
    count, count32 = sums["count"], sums32["count"]
    assert int(count) == int(count32) == int((batch["labels"] >= 0).sum())
    np.testing.assert_allclose(float(total), float(total32), rtol=1e-5)
    for (path, g), r in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref)):
        assert g.dtype == jnp.float32, jax.tree_util.keystr(path)
        # each of the 4 micro-batch gradients is rounded to bfloat16 once: 4 * 2**-9 of the largest entry at most
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0, atol=4 * 2**-9 * float(jnp.abs(r).max()),
                                   err_msg=jax.tree_util.keystr(path))


def test_training_reduces_loss_on_a_fixed_batch(seed):
    mesh = make_mesh(fsdp=2, sp=4)
    tx = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), 20)
    graphdef, state = fresh(mesh, tx)
    step = make_train_step(graphdef, tx, make_schedule(OptimConfig(lr=1e-2, warmup_steps=0), 20), mesh,
                           state_shardings(state))
    batch = random_batch(seed, rows=2)
    losses = []
    for _ in range(8):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0] - 0.1
    assert int(state["step"]) == 8


def test_checkpoint_restores_onto_another_mesh(tmp_path):
    """Saved on fsdp=2 x sp=4, restored onto fsdp=4 x sp=2 (and sp=8): same values, new layout."""
    tx = make_optimizer(OptimConfig(), 10)
    mesh_a = make_mesh(fsdp=2, sp=4)
    graphdef, state = fresh(mesh_a, tx)
    step = make_train_step(graphdef, tx, make_schedule(OptimConfig(), 10), mesh_a, state_shardings(state))
    state, _ = step(state, random_batch(0, rows=2))  # non-trivial optimizer state
    saved = jax.tree.map(np.asarray, state)
    ck = Checkpointer(tmp_path, keep=2)
    ck.save(1, state, {"it": 1})
    ck.close()
    for mesh_kw in (dict(fsdp=4, sp=2), dict(fsdp=1, sp=8)):
        mesh_b = make_mesh(**mesh_kw)
        _, target = abstract_state(CFG, mesh_b, tx)
        ck = Checkpointer(tmp_path, keep=2)
        restored, data_state = ck.restore(ck.latest_step(), target)
        ck.close()
        assert data_state == {"it": 1}
        for a, b, t in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), jax.tree.leaves(target)):
            np.testing.assert_array_equal(np.asarray(a), b)
            assert a.sharding.is_equivalent_to(t.sharding, a.ndim) and a.sharding.mesh.shape == mesh_b.shape


def test_incomplete_save_is_never_the_latest(tmp_path):
    """Orbax finalises a step by renaming its temporary directory: a half-written one is not listed."""
    tx = make_optimizer(OptimConfig(), 10)
    _, state = fresh(make_mesh(fsdp=2, sp=4), tx)
    ck = Checkpointer(tmp_path, keep=3)
    ck.save(1, state, {})
    ck.close()
    partial = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-1234"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "half_written").write_bytes(b"\0" * 10)
    ck = Checkpointer(tmp_path, keep=3)
    assert ck.latest_step() == 1 and ck.steps() == [1]
    ck.close()


def test_a_checkpoint_of_another_layout_says_so_and_offers_no_other_step(tmp_path):
    """A checkpoint whose parameter tree differs from the model's (another model, or a LoRA + --fp8 run from before its
    base rested in float8) is refused in one sentence that says so; no other step of the run is offered (they all have
    the same tree)."""
    tx = make_optimizer(OptimConfig(), 10)
    mesh = make_mesh(fsdp=2, sp=4)
    _, state = fresh(mesh, tx)
    ck = Checkpointer(tmp_path, keep=3)
    ck.save(1, state, {})
    ck.save(2, state, {})
    ck.close()
    _, target = abstract_state(dataclasses.replace(CFG, qkv_bias=True), mesh, tx)
    ck = Checkpointer(tmp_path, keep=3)
    with pytest.raises(ValueError, match=r"checkpoint .*checkpoints/2 holds parameters laid out unlike this model's "
                                         r".*; start a new --run-dir, or resume it with the version that wrote it$"):
        ck.restore(2, target)
    ck.close()


@pytest.mark.parametrize("saved_offload", [True, False], ids=["by-layer-to-stacked", "stacked-to-by-layer"])
def test_a_checkpoint_resumes_across_the_optimizer_state_layouts(tmp_path, saved_offload):
    """--optim.offload keeps the optimizer state by layer (a list of arrays per stacked parameter), the on-device
    optimizer stacked: a run saved with one resumes with the other (--memory auto may pick either), with the same
    values in the target's shardings and memory kinds; export reads the float32 master weights from either; and a
    checkpoint of another model is still refused as one, whichever layout the target has."""
    cfg = dataclasses.replace(CFG, num_layers=3, param_dtype="bfloat16")
    mesh = make_mesh(fsdp=2, sp=4)
    txs = {off: make_optimizer(OptimConfig(master_weights=True, offload=off), 10) for off in (True, False)}
    tx = txs[saved_offload]
    graphdef, state = init_state(cfg, mesh, tx, seed=0)
    step = make_train_step(graphdef, tx, make_schedule(OptimConfig(), 10), mesh, state_shardings(state))
    state, _ = step(state, random_batch(0, rows=2))  # moments not zero
    assert optimizer.is_layered(state["opt_state"]) == saved_offload
    saved = jax.tree.map(np.asarray, optimizer.stacked_layers(state))
    ck = Checkpointer(tmp_path, keep=2)
    ck.save(1, state, {"it": 1})
    ck.close()
    _, target = abstract_state(cfg, mesh, txs[not saved_offload])
    ck = Checkpointer(tmp_path, keep=2)
    restored, data_state = ck.restore(1, target)
    assert data_state == {"it": 1} and optimizer.is_layered(restored["opt_state"]) != saved_offload
    assert jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), restored) == jax.tree.map(
        lambda x: (x.shape, x.dtype, x.sharding), target)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(restored["opt_state"]) if x.ndim} == {
        "device" if saved_offload else "pinned_host"}
    got = jax.tree.map(np.asarray, optimizer.stacked_layers(restored))
    for (path, a), b in zip(jax.tree.leaves_with_path(saved), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    ck.close()
    ck = Checkpointer(tmp_path, create=False)  # as export reads it
    master = ck.restore_master(1, target["params"])
    for a, b in zip(jax.tree.leaves(saved["opt_state"].master), jax.tree.leaves(master), strict=True):
        assert b.dtype == np.float32
        np.testing.assert_array_equal(a, np.asarray(b))
    _, other = abstract_state(dataclasses.replace(cfg, qkv_bias=True), mesh, tx)
    with pytest.raises(ValueError, match=r"checkpoint .*checkpoints/1 holds parameters laid out unlike this model's"):
        ck.restore(1, other)
    ck.close()


def test_a_damaged_checkpoint_of_the_other_layout_says_damaged(tmp_path):
    """A checkpoint of the optimizer state kept by layer whose arrays are damaged, resumed with the state stacked: the
    other layout's tree matches but its data cannot be read, and the error says so (damaged), not that the checkpoint
    holds another model's parameters (the first try's tree mismatch)."""
    cfg = dataclasses.replace(CFG, num_layers=2, param_dtype="bfloat16")
    mesh = make_mesh(fsdp=2, sp=4)
    txs = {off: make_optimizer(OptimConfig(master_weights=True, offload=off), 10) for off in (True, False)}
    _, state = init_state(cfg, mesh, txs[True], seed=0)
    ck = Checkpointer(tmp_path, keep=2)
    ck.save(1, state, {})
    ck.close()
    data = [f for f in (tmp_path / "checkpoints" / "1" / "train").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert data
    for f in data:  # the arrays' bytes; the tree's metadata stays readable
        f.write_bytes(b"garbage")
    _, target = abstract_state(cfg, mesh, txs[False])
    ck = Checkpointer(tmp_path, keep=2)
    with pytest.raises(ValueError, match=r"checkpoint .*checkpoints/1 is damaged or not from this run"):
        ck.restore(1, target)
    ck.close()


def test_the_layers_of_the_state_split_and_stack_back():
    """``per_layer`` lists a stacked leaf's layers (arrays, ``ShapeDtypeStruct``s and shardings, the layer axis dropped
    from the spec); ``stacked_layers`` gives the stacks back; a stack sharded over its layer axis is refused in one
    line; and the streamed update refuses a state kept by layer with the layers' parameters in host memory."""
    mesh = make_mesh(fsdp=2, sp=4)
    x = jnp.arange(24.0).reshape(3, 2, 4)
    tree = {"blocks": {"w": x}, "embed": jnp.ones((2,))}
    split = optimizer.per_layer(tree)
    assert len(split["blocks"]["w"]) == 3 and split["embed"] is tree["embed"]
    np.testing.assert_array_equal(split["blocks"]["w"][1], x[1])
    np.testing.assert_array_equal(optimizer.stacked_layers(split)["blocks"]["w"], x)
    sh = NamedSharding(mesh, P(None, "fsdp"), memory_kind="pinned_host")
    shardings = optimizer.per_layer({"blocks": {"w": sh}, "embed": sh}, like=tree)
    assert shardings["blocks"]["w"] == [NamedSharding(mesh, P("fsdp"), memory_kind="pinned_host")] * 3
    abstract = optimizer.per_layer({"blocks": {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)}})
    assert optimizer.stacked_layers(abstract)["blocks"]["w"].sharding == sh
    with pytest.raises(ValueError, match=r"a stacked parameter's layer axis is sharded \(P\('fsdp',\)\)"):
        optimizer.per_layer({"blocks": {"w": NamedSharding(mesh, P("fsdp"))}}, like={"blocks": {"w": x}})
    tx = optimizer.Optimizer.of(1.0, optax.adamw(1e-3), offload=True)
    params = {"blocks": {"w": x}}
    state = tx.init(optimizer.per_layer(params))
    assert optimizer.is_layered(state) and not optimizer.is_layered(tx.init(params))
    with pytest.raises(ValueError, match="the optimizer state is kept by layer"):
        optimizer.streamed_update(tx, params, state, params, host_params=True)


def test_the_streamed_update_takes_each_stack_length_as_the_on_device_update(seed):
    """The host optimizer's update (master weights, global-norm clipping, the state kept by layer in pinned host
    memory) of stacks of three lengths, a hybrid's (the MLP over 3 layers, the delta-net over 2, attention over 1: a
    loop each), and a parameter not stacked: over two steps, the on-device optimizer's parameters, state and gradient
    norm (equal here; held to 1-2 ulp as the model's test holds them, whose hybrid case runs in make test-slow). A
    stack length left out of the update would keep its parameters."""
    mesh = make_mesh(fsdp=2, sp=4)
    rng = np.random.default_rng(seed)
    shapes = {"blocks": {"mlp": (3, 8, 16), "delta": (2, 8, 8), "attn": (1, 8, 8)}, "embed": (16, 8)}

    def draw(scale):
        return jax.tree.map(lambda s: jax.device_put(jnp.asarray(rng.normal(size=s) * scale, jnp.bfloat16),
                                                     NamedSharding(mesh, P(*(None,) * (len(s) - 2), "fsdp"))),
                            shapes, is_leaf=lambda x: isinstance(x, tuple))

    params, grads, denom = draw(0.05), draw(3.0), jnp.float32(2.0)  # clipped at 1: the norm is about 40
    tx = optimizer.Optimizer.of(1.0, optax.adamw(1e-2), master_weights=True, offload=True)

    @jax.jit
    def on_device(grads, state, params):
        grads = jax.tree.map(lambda g: (g / denom).astype(g.dtype), grads)
        return *optimizer.apply(tx.on_device, grads, state, params), optimizer.norm_f32(grads)

    streamed = jax.jit(lambda g, st, p: optimizer.streamed_update(tx, g, st, p, denom=denom))
    state = jax.jit(tx.on_device.init)(params)
    host = jax.jit(optimizer.initialised_in_host_memory(tx, lambda p: tx.init(optimizer.per_layer(p))))(params)
    assert optimizer.is_layered(host) and {x.sharding.memory_kind for x in jax.tree.leaves(host) if x.ndim} == {
        "pinned_host"}
    for _ in range(2):
        (new, state, norm), (new_streamed, host, norm_streamed) = on_device(grads, state, params), streamed(
            grads, host, params)
        np.testing.assert_allclose(float(norm_streamed), float(norm), rtol=1e-6)
        assert float(norm) > 10
        for (path, x), y in zip(jax.tree.leaves_with_path((new, state)),
                                jax.tree.leaves((new_streamed, optimizer.stacked_layers(host))), strict=True):
            x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
            rtol, atol = (2**-7, 0.0) if path[0].idx == 0 else (1e-6, 1e-9)  # the parameters are bfloat16
            np.testing.assert_allclose(y, x, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))
        assert not any(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(params),
                                                                                    jax.tree.leaves(new)))
        params = new


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    tx = make_optimizer(OptimConfig(), 10)
    mesh = make_mesh(fsdp=2, sp=4)
    _, state = fresh(mesh, tx)
    ck = Checkpointer(tmp_path, keep=3)
    ck.save(1, state, {})
    ck.close()
    for f in (tmp_path / "checkpoints" / "1" / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(b"garbage")
    _, target = abstract_state(CFG, mesh, tx)
    ck = Checkpointer(tmp_path, keep=3)
    with pytest.raises(ValueError, match=r"checkpoint .*checkpoints/1 is damaged or not from this run .*; start a "
                                         r"new --run-dir"):
        ck.restore(1, target)
    ck.close()


def test_weight_decay_skips_norms_and_biases():
    from flax import nnx

    from ulysses_jax.train.step import decay_mask

    cfg = dataclasses.replace(ModelConfig.from_preset("qwen2.5-0.5b"), num_layers=2, hidden=64, num_heads=4,
                              num_kv_heads=2, head_dim=16, mlp_dim=128, vocab_size=256)
    abstract = nnx.state(nnx.eval_shape(lambda: __import__("ulysses_jax").Transformer(
        cfg, mesh=make_mesh(fsdp=8), rngs=nnx.Rngs(0))))
    flags = {jax.tree_util.keystr(p): m for p, m in jax.tree_util.tree_leaves_with_path(decay_mask(abstract))}
    decayed = sorted(k for k, m in flags.items() if m)
    kept = sorted(k for k, m in flags.items() if not m)
    assert all(("norm" in k or "['b" in k) for k in kept) and len(kept) == 6  # 3 norms, 3 biases
    assert any("embed_VD" in k for k in decayed) and any("wq_DNH" in k for k in decayed)


@pytest.mark.parametrize("param_dtype, accum", [("float32", 1), ("bfloat16", 1), ("bfloat16", 2)])
def test_state_dtypes_and_shardings_unchanged_by_a_step(param_dtype, accum):
    """The step's new state has the dtypes and shardings of the state it was given, so the donated buffers alias
    (a bfloat16 AdamW moment that came back float32 would double its memory and stop the aliasing), with gradients
    accumulated in float32 too."""
    cfg = dataclasses.replace(CFG, param_dtype=param_dtype, compute_dtype="bfloat16")
    mesh = make_mesh(fsdp=2, sp=4)
    tx = make_optimizer(OptimConfig(), 10)
    graphdef, state = init_state(cfg, mesh, tx, seed=0)
    step = make_train_step(graphdef, tx, make_schedule(OptimConfig(), 10), mesh, state_shardings(state),
                           grad_accum=accum)
    batch = random_batch(0, rows=2 * accum)
    before = jax.tree.leaves_with_path(state)
    compiled = step.lower(state, batch).compile()
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state)) // len(jax.devices())
    for _ in range(2):  # the second step runs on the first one's output
        state, metrics = step(state, batch)
        assert metrics["grad_norm"].dtype == jnp.float32  # summed in float32 whatever the gradients' dtype
        after = jax.tree.leaves_with_path(state)
        assert [p for p, _ in after] == [p for p, _ in before]
        for (path, x0), (_, x1) in zip(before, after):
            assert x1.dtype == x0.dtype, jax.tree_util.keystr(path)
            assert x1.sharding.spec == x0.sharding.spec and x1.sharding.mesh == x0.sharding.mesh
    for leaf in jax.tree.leaves(state["opt_state"]):
        if leaf.ndim:
            assert leaf.dtype == jnp.dtype(param_dtype)
    assert compiled.memory_analysis().alias_size_in_bytes >= 0.9 * state_bytes  # the donated state is reused


# a hybrid: 3 layers (linear, global, linear), so stacks of 3 (norms, MLP), 2 (the delta-net) and 1 (attention) layers
HYBRID_STACKS = dict(num_layers=3, layer_pattern=("linear", "global"), linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=8, linear_value_head_dim=8)


@pytest.mark.parametrize("param_dtype, master, fields", [
    pytest.param("float32", False, dict(num_layers=2), marks=pytest.mark.slow),
    # the hybrid (50 s) in make test-slow; its three stack lengths stay in the default suite in
    # test_the_streamed_update_takes_each_stack_length_as_the_on_device_update, --offload-params in the second case
    ("bfloat16", True, dict(num_layers=2)), pytest.param("bfloat16", True, HYBRID_STACKS, marks=pytest.mark.slow)])
def test_offloaded_optimizer_equals_the_on_device_one(param_dtype, master, fields):
    """--optim.offload: the optimizer state in pinned host memory, updated layer by layer, gives the on-device
    optimizer's parameters and state (to float32 rounding: XLA fuses the per-layer update differently, 1-2 ulp),
    and the state keeps its dtypes, shardings and memory kinds; on a hybrid too, whose stacks have three lengths
    (each length its own loop). The CPU backend keeps host and device in one memory: this checks values and memory
    kinds, not where XLA puts the bytes (test_plan.py compiles for H100)."""
    mesh = make_mesh(fsdp=2, sp=4)
    batch = random_batch(0, rows=2)
    results = []
    # on the device; the optimizer state in host memory; that and the stacked layers' parameters (--offload-params)
    hybrid = "layer_pattern" in fields  # --offload-params is refused on a hybrid (test_hybrid_model.py)
    for off, params_off in ((False, False), (True, False)) + (() if hybrid else ((True, True),)):
        cfg = dataclasses.replace(CFG, param_dtype=param_dtype, offload_params=params_off, **fields)
        optim = OptimConfig(lr=1e-2, warmup_steps=0, master_weights=master, offload=off)
        tx = make_optimizer(optim, 10)
        graphdef, state = init_state(cfg, mesh, tx, seed=0)
        step = make_train_step(graphdef, tx, make_schedule(optim, 10), mesh, state_shardings(state))
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state["opt_state"]) if x.ndim}
        assert kinds == {"pinned_host" if off else "device"}
        # in host memory with the layers' parameters on the device: a list of arrays per stacked parameter
        assert optimizer.is_layered(state["opt_state"]) == (off and not params_off)
        layer_kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state["params"]["blocks"])}
        assert layer_kinds == {"pinned_host" if params_off else "device"}
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state["params"]["embed_VD"])} == {"device"}
        before = jax.tree.map(lambda x: (x.dtype, x.sharding), state)
        step = step.lower(state, batch).compile(USERS_CPU_CODEGEN)  # 1-2 ulp apart as users compile (conftest.py)
        state, first = step(state, batch)
        after_one = jax.tree.map(np.asarray, optimizer.stacked_layers(state))  # compared stack by stack
        state, second = step(state, batch)
        assert jax.tree.map(lambda x: (x.dtype, x.sharding), state) == before
        results.append((float(first["loss"]), float(second["loss"]), float(first["grad_norm"]), after_one))
    first_a, second_a, norm_a, a = results[0]
    for first_b, second_b, norm_b, b in results[1:]:
        assert first_a == first_b
        np.testing.assert_allclose(second_a, second_b, rtol=1e-6)
        # the norm in float32 either way (bfloat16 gradients too: optax.tree.norm alone added the leaves in bfloat16,
        # 2**-8 apart from the streamed float32 sum)
        np.testing.assert_allclose(norm_a, norm_b, rtol=1e-5)
        for (path, x), y in zip(jax.tree.leaves_with_path(a), jax.tree.leaves(b)):
            # float32: 1-2 ulp of the weights and of lr; a master weight 1 ulp apart may round to the next bfloat16;
            # a weight the update brought near zero keeps the float32 difference at the leaf's scale (1.9e-9 on
            # weights of 0.05 seen; 18 of 131,072 elements beyond a relative tolerance alone)
            scale = float(np.max(np.abs(x.astype(np.float64)))) if x.size else 0.0
            rtol, atol = (2**-7, 4 * 2**-24 * scale) if x.dtype == jnp.bfloat16 else (1e-6, 1e-8)
            np.testing.assert_allclose(x.astype(np.float64), y.astype(np.float64), rtol=rtol, atol=atol,
                                       err_msg=jax.tree_util.keystr(path))


# Gemma 3 at CPU size with mixed layers: local, local, global, local (window 7 tokens, local RoPE base 10000)
GEMMA_MIXED = ModelConfig.from_preset(
    "gemma3-4b", num_layers=4, hidden=64, num_heads=8, num_kv_heads=2, head_dim=16, mlp_dim=128, vocab_size=256,
    query_pre_attn_scalar=16.0, sliding_window=7, layer_pattern=("local", "local", "global"), compute_dtype="float32")


@pytest.mark.parametrize("tools", [dict(), pytest.param(dict(remat="full", mlp_chunk=4), marks=pytest.mark.slow)],
                         ids=["plain", "remat-tiled-mlp"])
def test_offloaded_params_with_mixed_layers_equal_the_on_device_step(tools):
    """--offload-params on Gemma 3 with local and global layers: each scanned layer's parameters streamed in from host
    memory and its gradient out (the layer's attention kind picked by the switch inside the same scan) give the
    on-device step's loss, gradient norm and updated parameters (float32; the streamed update fuses differently:
    1-2 ulp). The stacked layers are in pinned host memory before and after the step."""
    assert GEMMA_MIXED.window_kinds == (None, 7) and GEMMA_MIXED.kind_of_layer == (1, 1, 0, 1)
    mesh = make_mesh(fsdp=2, sp=4)
    batch = random_batch(1, rows=2, vocab=GEMMA_MIXED.vocab_size)
    results = []
    for off in (False, True):
        cfg = dataclasses.replace(GEMMA_MIXED, offload_params=off, **tools)
        optim = OptimConfig(lr=1e-2, warmup_steps=0, offload=off)
        tx = make_optimizer(optim, 10)
        graphdef, state = init_state(cfg, mesh, tx, seed=0)
        before = jax.tree.map(np.asarray, state["params"])
        layer_kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state["params"]["blocks"])}
        assert layer_kinds == {"pinned_host" if off else "device"}
        step = make_train_step(graphdef, tx, make_schedule(optim, 10), mesh, state_shardings(state))
        state, metrics = step.lower(state, batch).compile(USERS_CPU_CODEGEN)(state, batch)  # as users compile
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state["params"]["blocks"])} == layer_kinds
        results.append((float(metrics["loss"]), float(metrics["grad_norm"]), jax.tree.map(np.asarray, state["params"])))
    (loss_a, norm_a, a), (loss_b, norm_b, b) = results
    assert np.isfinite(loss_a) and loss_a == pytest.approx(loss_b, rel=1e-6)
    np.testing.assert_allclose(norm_a, norm_b, rtol=1e-6)
    for (path, x), y, x0 in zip(jax.tree.leaves_with_path(a), jax.tree.leaves(b), jax.tree.leaves(before)):
        name = jax.tree_util.keystr(path)
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-8, err_msg=name)
        # every parameter moved, each layer of a stacked one (local and global, post-norms included)
        slices = zip(x0, y) if "blocks" in name else [(x0, y)]
        assert all(not np.array_equal(u, v) for u, v in slices), name
