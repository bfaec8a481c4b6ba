"""Mixtures of experts: the routed MLP against a dense per-token reference (outputs and gradients), the model on
fsdp 2 x sp 4 against one device (loss, load-balancing loss, expert load, gradients; plain, tiled MLP, remat), the
presets' parameter counts and the refusals. Hugging Face parity and training through the CLI: tests/test_moe_hf.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ulysses_jax as uj
from ulysses_jax.model import flops, moe
from ulysses_jax.model.config import ModelConfig

TINY = ModelConfig.from_preset("tiny-moe", vocab_size=128, num_layers=3, hidden=32, mlp_dim=48, moe_mlp_dim=16,
                               num_heads=4, num_kv_heads=2, head_dim=8, dense_layers=(1,), num_experts=4,
                               experts_per_token=2, attention_impl="xla", router_aux_loss_coef=0.01)


def dense_reference(x, wr, wg, wu, wd, k, renormalize):
    """Every expert on every token, weighted by a ``[t, E]`` matrix that is the top-k weight or 0: no dispatch."""
    probs = jax.nn.softmax(x @ wr, axis=-1)
    top, idx = jax.lax.top_k(probs, k)
    if renormalize:
        top = top / top.sum(-1, keepdims=True)
    weight_tE = jnp.zeros_like(probs).at[jnp.arange(x.shape[0])[:, None], idx].set(top)
    y_tED = jnp.einsum("tef,efd->ted", jax.nn.silu(jnp.einsum("td,edf->tef", x, wg)) * jnp.einsum(
        "td,edf->tef", x, wu), wd)
    return jnp.einsum("ted,te->td", y_tED, weight_tE)


@pytest.mark.parametrize("renormalize, impl", [(True, "ragged_dot"), (False, "pallas")])
def test_routed_experts_match_every_expert_weighted(seed, renormalize, impl):
    rng = np.random.default_rng(seed)
    t, d, e, f, k = 40, 32, 4, 16, 2  # the Pallas kernel tiles by 16 at least
    args = [jnp.asarray(rng.normal(size=s) * c, jnp.float32) for s, c in
            (((t, d), 1.0), ((d, e), 0.5), ((e, d, f), 0.3), ((e, d, f), 0.3), ((e, f, d), 0.3))]
    r = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)  # a random cotangent

    def mlp(x, wr, wg, wu, wd):
        ws = dict(w_router_DE=wr, w_gate_EDF=wg, w_up_EDF=wu, w_down_EFD=wd)
        return moe.experts_mlp(x, ws, k=k, renormalize=renormalize, impl=impl)  # pallas: interpret mode on CPU

    def ours(*a):
        return jnp.sum(mlp(*a) * r)

    def ref(*a):
        return jnp.sum(dense_reference(*a, k, renormalize) * r)

    y = mlp(*args)
    np.testing.assert_allclose(y, dense_reference(*args, k, renormalize), atol=1e-5, rtol=1e-5)
    for g, want in zip(jax.grad(ours, argnums=range(5))(*args), jax.grad(ref, argnums=range(5))(*args)):
        np.testing.assert_allclose(g, want, atol=1e-5, rtol=1e-4)
    # the router decides: other router weights, other experts, another output
    other = mlp(args[0], -args[1], *args[2:])
    assert float(jnp.abs(other - y).max()) > 1e-2


def load_balancing_reference(logits_LtE, valid_t, k):
    """transformers' loss written out in NumPy: pooled over layers and valid tokens."""
    probs = np.exp(logits_LtE - logits_LtE.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[..., :k]
    e = probs.shape[-1]
    assigned = np.zeros(e)
    for layer in range(probs.shape[0]):
        for j in range(k):
            np.add.at(assigned, top[layer, :, j], valid_t)
    rows = valid_t.sum() * probs.shape[0]
    return e * np.sum((assigned / rows) * ((probs * valid_t[None, :, None]).sum((0, 1)) / rows)), assigned


def test_aux_loss_is_transformers_formula(seed):
    rng = np.random.default_rng(seed)
    layers, t, e, k = 3, 50, 6, 2
    logits = rng.normal(size=(layers, t, e))
    valid = (rng.random(t) > 0.2).astype(np.float64)
    # the router's input times the identity: its logits are ``logits``
    sums = [moe.router_sums(jnp.asarray(logits[i], jnp.float32), jnp.eye(e), jnp.asarray(valid > 0), k)
            for i in range(layers)]
    stats = moe.RouterStats(jnp.stack([s[0] for s in sums]), jnp.stack([s[1] for s in sums]), sums[0][2])
    want, assigned = load_balancing_reference(logits, valid, k)
    np.testing.assert_allclose(float(moe.aux_loss(stats)), want, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(moe.expert_load(stats)), assigned.astype(int))
    # perfectly balanced: every expert gets tokens * k / E assignments and 1/E of the probability: the loss is k
    tokens = 60.0
    balanced = moe.RouterStats(jnp.full((layers, e), tokens * k / e), jnp.full((layers, e), tokens / e),
                               jnp.asarray(tokens))
    np.testing.assert_allclose(float(moe.aux_loss(balanced)), k, rtol=1e-6)


def batch_of(seed, rows=2, seq=32):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, TINY.vocab_size, (rows, seq))
    segment_ids = np.ones((rows, seq), np.int32)
    segment_ids[1, 10:] = 2
    segment_ids[1, 28:] = 0  # padding: left out of the router's statistics
    labels = np.array(uj.shift_labels(jnp.asarray(tokens), jnp.asarray(segment_ids)))
    labels[segment_ids == 0] = -1
    return {k: jnp.asarray(v) for k, v in dict(tokens=tokens, labels=labels, segment_ids=segment_ids).items()}


def loss_and_grads(cfg, mesh, batch):
    model = uj.Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state):
        def f(st):
            out = uj.next_token_loss(nnx.merge(graphdef, st), batch)
            return out.loss, out
        return jax.value_and_grad(f, has_aux=True)(state)

    (_, out), grads = run(state)
    return out, {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(grads)}


@pytest.mark.parametrize("variant", [{}, pytest.param(dict(mlp_chunk=8, remat="full"), marks=pytest.mark.slow)])
def test_eight_devices_equal_one(seed, variant):
    """Loss (with the weighted load-balancing loss), its parts, the expert load and every gradient: fsdp 2 x sp 4
    (optionally the tiled MLP and remat) against one device."""
    batch = batch_of(seed)
    one, g1 = loss_and_grads(TINY, uj.make_mesh(fsdp=1, sp=1, devices=jax.devices()[:1]), batch)
    eight, g8 = loss_and_grads(dataclasses.replace(TINY, **variant), uj.make_mesh(fsdp=2, sp=4), batch)
    assert float(one.aux_loss) > 0.9  # near top-k when balanced: E x the sum of f_e P_e, the f_e summing to k
    np.testing.assert_allclose(float(eight.loss), float(one.loss), rtol=1e-5)
    np.testing.assert_allclose(float(eight.aux_loss), float(one.aux_loss), rtol=1e-5)
    np.testing.assert_allclose(float(one.loss), float(one.sum / one.count) + 0.01 * float(one.aux_loss), rtol=1e-6)
    load = np.asarray(one.expert_load)
    assert load.sum() == 2 * (2 * 32 - 4) * 2  # 2 sparse layers x 60 valid tokens x top-2
    np.testing.assert_array_equal(np.asarray(eight.expert_load), load)
    assert set(g1) == set(g8) and "blocks.moe.w_router_DE" in g1 and "blocks.mlp.w_gate_DF" in g1
    for name in g1:
        np.testing.assert_allclose(g8[name], g1[name], atol=2e-6, rtol=2e-4, err_msg=name)
    # each MLP kind stacked over its own layers (the experts over layers 0 and 2, the dense MLP over layer 1), every
    # row trained; the load-balancing loss and the routing reach the router
    assert g1["blocks.moe.w_gate_EDF"].shape[0] == 2 and g1["blocks.mlp.w_up_DF"].shape[0] == 1
    assert all(g1["blocks.moe.w_gate_EDF"][i].any() and g1["blocks.moe.w_router_DE"][i].any() for i in (0, 1))
    assert g1["blocks.mlp.w_up_DF"][0].any()


def test_a_model_mixing_dense_and_sparse_layers_stores_each_mlp_once():
    """The dense MLP stacked over the dense layer, the experts over the sparse ones: the model stores the parameters
    it has (``param_count``; before, every layer held both), and --offload-params is refused in one line."""
    model = nnx.eval_shape(lambda: uj.Transformer(TINY, mesh=uj.make_mesh(devices=jax.devices()[:1]), rngs=nnx.Rngs(0)))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == flops.param_count(TINY)
    assert TINY.stacked_apart == ("mlp", "moe") and TINY.stacked_layers("moe") == (0, 2)
    assert TINY.stack_rows("mlp") == (0, 0, 0) and TINY.stack_rows("moe") == (0, 0, 1)
    with pytest.raises(ValueError, match=r"this model's dense and sparse MLPs are stacked over their own layers"):
        dataclasses.replace(TINY, offload_params=True)


def test_presets_have_the_published_parameter_counts():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B active; Mixtral 8x7B: 46.7B, 12.9B active (the model cards)."""
    for name, total, active in (("qwen3-30b-a3b", 30.5e9, 3.3e9), ("mixtral-8x7b", 46.7e9, 12.9e9)):
        cfg = ModelConfig.from_preset(name)
        assert abs(flops.param_count(cfg) - total) < 0.1e9, name  # published to 0.1B
        assert abs(flops.active_param_count(cfg) - active) < 0.1e9, name
    qwen = ModelConfig.from_preset("qwen3-30b-a3b")
    assert (qwen.num_experts, qwen.experts_per_token, qwen.expert_mlp_dim, qwen.sparse_layers) == (
        128, 8, 768, tuple(range(48)))
    # training FLOPs count the active experts: 3.3B-parameter matmuls, not 30.5B
    assert 2.9e9 < flops.matmul_params(qwen) < 3.1e9


@pytest.mark.parametrize("fields, message", [
    (dict(experts_per_token=5), r"experts_per_token \(5\) must be between 1 and num_experts \(4\)"),
    (dict(num_experts=1, experts_per_token=1), r"num_experts \(1\) must be at least 2"),
    (dict(dense_layers=(0, 1, 2)), r"dense_layers lists every layer \(3\)"),
    (dict(dense_layers=(3,)), r"dense_layers \[3\] must be distinct layer indices in 0..2"),
    (dict(moe_impl="megablox"), r"moe_impl 'megablox' is not one of auto, pallas, ragged_dot"),
    (dict(num_experts=0, experts_per_token=0), r"describe experts, but num_experts is 0"),
])
def test_invalid_expert_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **fields)
