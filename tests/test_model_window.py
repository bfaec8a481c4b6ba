"""Mixed local (sliding-window) and global layers in the scanned model: the window reaches each local layer and no
global one, the scan is not unrolled, sharded meshes and every memory tool equal the plain path."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_model import MESHES, assert_same, build, forward, packed_batch, run_model, shrink

from ulysses_jax import ModelConfig, Transformer, make_mesh
from ulysses_jax.model.layer_kinds import layer_types

# 4 layers: local, local, global, local (pattern of 3 repeated and cut); window 7 tokens; local RoPE base 10000
MIXED = dict(sliding_window=7, layer_pattern=("local", "local", "global"), rope_local_theta=10_000.0, num_layers=4)


def mixed(**overrides):
    return shrink("qwen3-8b", num_kv_heads=4, head_dim=16, rope_theta=1e6, **{**MIXED, **overrides})


def test_layer_types_and_kinds():
    cfg = mixed()
    assert layer_types(cfg) == ("local", "local", "global", "local")
    assert cfg.window_kinds == (None, 7) and cfg.kind_of_layer == (1, 1, 0, 1)
    assert mixed(layer_pattern=()).window_kinds == (7,)  # a window, no pattern: every layer local
    assert ModelConfig().window_kinds == (None,)


@pytest.mark.parametrize("bad, match", [
    (dict(sliding_window=-1), r"sliding_window \(-1\) must be 0 \(no local layers\) or a positive number"),
    (dict(layer_pattern=("local", "chunked")), r"layer_pattern has 'chunked', an unknown layer type"),
    (dict(sliding_window=0), r"layer_pattern has 'local' layers but sliding_window is 0"),
    (dict(layer_pattern=("local",) * 5), r"layer_pattern has 5 entries for 4 layers"),
])
def test_bad_layer_settings_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        mixed(**bad)


def test_window_reaches_local_layers_only(seed):
    """One layer, window 1: a local layer's output at t depends on token t alone (changing token 0 moves nothing
    after it); a global layer's does depend on it. Positions and RoPE bases as the config says."""
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 256, (8, 64)), jnp.int32)
    changed = tokens.at[:, 0].set((tokens[:, 0] + 1) % 256)
    for kind, moves in (("local", False), ("global", True)):
        cfg = mixed(num_layers=1, sliding_window=1, layer_pattern=(kind,))
        model = build(cfg, "sp4", seed)
        a, b = forward(model, tokens), forward(model, changed)
        assert bool(jnp.any(jnp.abs(a[:, 1:] - b[:, 1:]) > 1e-6)) == moves, kind


def test_local_rope_base_is_used(seed):
    """The local layers' RoPE base changes the logits; a global-only model ignores it."""
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 256, (8, 64)), jnp.int32)
    base = forward(build(mixed(), "1dev", seed), tokens)
    other = forward(build(mixed(rope_local_theta=500.0), "1dev", seed), tokens)
    assert float(jnp.max(jnp.abs(base - other))) > 1e-4
    glob = dict(layer_pattern=("global",), sliding_window=0)
    np.testing.assert_array_equal(forward(build(mixed(**glob), "1dev", seed), tokens),
                                  forward(build(mixed(**glob, rope_local_theta=500.0), "1dev", seed), tokens))


def test_scan_is_not_unrolled():
    """The traced forward has as many equations for 12 mixed layers as for 4: one scan, a switch per layer."""
    def count(n):
        cfg = mixed(num_layers=n)
        model = nnx.eval_shape(lambda: Transformer(cfg, mesh=make_mesh(devices=jax.devices()[:1]), rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(model)
        jaxpr = jax.make_jaxpr(lambda st, t: nnx.merge(graphdef, st)(t))(state, jnp.zeros((1, 16), jnp.int32))
        text = str(jaxpr)
        return len(jaxpr.jaxpr.eqns), text.count("cond[")

    assert count(4) == count(12)
    assert count(4)[1] >= 1


# mesh x memory tool (each against the plain single-device model): plain sharded, ring, remat, every-k, tiled
# attention with head groups and recompute, tiled MLP, offloaded layer inputs
CASES = [
    ("sp4", dict(attention_impl="blockwise")),
    ("fsdp2xsp4", dict(attention_impl="pallas")),
    ("sp4", dict(remat="full", remat_every=2)),
    ("fsdp2xsp4", dict(remat="offload")),
    ("sp4", dict(attn_chunk=4, attn_head_chunk=1, attention_impl="blockwise")),
    ("sp2", dict(attn_chunk=8, attn_recompute=True, attention_impl="xla", remat="full")),
    ("data2xfsdp2xsp2-zero3", dict(mlp_chunk=4)),
]


@pytest.mark.parametrize("mesh_name, tools", CASES, ids=[f"{m}-{'-'.join(t)}" for m, t in CASES])
def test_memory_tools_equal_plain_with_mixed_layers(mesh_name, tools, seed):
    cfg = mixed(attention_impl="xla")
    batch = packed_batch(seed)
    plain = run_model(build(cfg, "1dev", seed), batch)
    cfg = dataclasses.replace(cfg, shard_params_over_data=MESHES[mesh_name][3], **tools)
    assert_same(run_model(build(cfg, mesh_name, seed), batch), plain)


def gemma(**overrides):
    """Gemma 3 at CPU size: (1 + w) norms around both sublayers, qk-norm, GeGLU, scaled embeddings, linear RoPE
    scaling on the global layers, tied; the mixed local/global layers of ``MIXED``."""
    return shrink("gemma3-4b", num_kv_heads=2, head_dim=16, query_pre_attn_scalar=16.0, **{**MIXED, **overrides})


GEMMA_CASES = [
    ("1dev", dict()),  # 64 tokens in 16 chunks on one device
    ("fsdp2xsp4", dict(remat="full")),  # FSDP, 16 local tokens in 4 chunks, each layer rematerialised
    ("data2xfsdp2xsp2-zero3", dict()),  # replicas, ZeRO-3 (the norm scales gathered over data x fsdp x sp)
]


@pytest.mark.parametrize("mesh_name, tools", GEMMA_CASES, ids=[f"{m}-{'-'.join(t)}" for m, t in GEMMA_CASES])
def test_gemma_tiled_mlp_equals_plain(mesh_name, tools, seed):
    """mlp_chunk on Gemma 3: each chunk runs the whole sublayer x + post_norm(mlp(pre_norm(x))) with (1 + w) norms
    and GeGLU; the logits, loss and gradients (the post-MLP norm's included) of the plain single-device model."""
    cfg = gemma(attention_impl="xla")
    assert cfg.post_norms and cfg.norm_plus_one and cfg.mlp_activation == "gelu_tanh"
    batch = packed_batch(seed)
    plain = run_model(build(cfg, "1dev", seed), batch)
    tiled = run_model(build(dataclasses.replace(cfg, mlp_chunk=4, **tools), mesh_name, seed), batch)
    assert_same(tiled, plain)
    grads = dict(nnx.to_flat_state(tiled[2]))
    post = [g for path, g in grads.items() if "post_mlp_norm" in path]
    assert post and all(float(jnp.max(jnp.abs(g.get_value()))) > 0 for g in post)  # the post-norm is in the chunks


GEMMA_ATTN_CASES = [
    ("1dev", dict(attn_chunk=8, attention_impl="blockwise")),  # 64 tokens in 8 chunks, all heads at once
    ("sp4", dict(attn_chunk=4, attn_head_chunk=1, attention_impl="blockwise")),  # 2 heads per device, 2 groups
    ("fsdp2xsp4", dict(attn_chunk=4, attention_impl="xla", remat="full", mlp_chunk=4)),  # with the tiled MLP
    ("data2xfsdp2xsp2-zero3", dict(attn_chunk=8, attn_head_chunk=2, attention_impl="pallas")),  # ZeRO-3, 2 groups
]


@pytest.mark.parametrize("mesh_name, tools", GEMMA_ATTN_CASES,
                         ids=[f"{m}-{'-'.join(f'{k}={v}' for k, v in t.items())}" for m, t in GEMMA_ATTN_CASES])
def test_gemma_tiled_attention_equals_plain(mesh_name, tools, seed):
    """attn_chunk on Gemma 3: the post-attention norm applied to each chunk of the output projection inside the
    sublayer's own backward; the logits, loss and gradients of the plain single-device model."""
    cfg = gemma(attention_impl="xla")
    batch = packed_batch(seed)
    plain = run_model(build(cfg, "1dev", seed), batch)
    tiled = run_model(build(dataclasses.replace(cfg, **tools), mesh_name, seed), batch)
    assert_same(tiled, plain)


def test_gemma_tiled_attention_refuses_recompute():
    with pytest.raises(ValueError, match=r"attn_recompute keeps no attention output, which the backward of the "
                                         r"post-attention norm \(post_norms, Gemma 3\) reads; set attn_recompute"):
        gemma(attn_chunk=4, attn_recompute=True)


def test_ring_mesh_equals_plain_with_mixed_layers(seed):
    """ring 2 x sp 4 (zigzag order, ring pairs outside the window skipped) against one device."""
    from test_model import TOL_GRAD, TOL_LOGITS, TOL_LOSS, S, rel_err
    from test_model_ring import build_on, loss_and_grads

    cfg = mixed(attention_impl="blockwise", num_layers=3)
    batch = packed_batch(seed, shard=S // 16)
    loss, grads, logits = loss_and_grads(build_on(cfg, make_mesh(fsdp=1, ring=2, sp=4), seed), batch)
    ref_loss, ref_grads, ref_logits = loss_and_grads(
        build_on(cfg, make_mesh(fsdp=1, sp=1, devices=jax.devices()[:1]), seed), batch)
    assert rel_err(logits, ref_logits) < TOL_LOGITS
    assert abs(float(loss) / float(ref_loss) - 1) < TOL_LOSS
    ref_flat = dict(nnx.to_flat_state(ref_grads))
    for path, g in nnx.to_flat_state(grads):
        assert rel_err(g.get_value(), ref_flat[path].get_value()) < TOL_GRAD, path
