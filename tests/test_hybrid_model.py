"""A hybrid model (delta-net and gated full-attention layers in one scan, Qwen3.5 / Qwen3-Next) on fake CPU devices:
sharded meshes and the memory tools (remat full / offload, the tiled MLP, ZeRO-3) equal the plain single-device model
(logits, loss, gradients, on packed rows); the experts' shared expert; the layer switch keeps one scan, each mixer stacked
over its own layers; LoRA on the
delta-net's projections as peft loads it on transformers' model."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_model import MESHES, assert_same, build, packed_batch, run_model, shrink

from ulysses_jax import Transformer, make_mesh

# 3 layers: linear, global, linear (the pattern cut at the model's depth); 8 heads of 16 (4 rotated), 2 KV heads;
# the delta-net: 2 key heads (copied over sp 4), 4 value heads of 8
HYBRID = dict(num_layers=3, layer_pattern=("linear", "global"), num_heads=8, num_kv_heads=2, head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              attention_impl="xla")


def hybrid(**overrides):
    return shrink("qwen3.5-9b", **{**HYBRID, **overrides})


def hybrid_moe(**overrides):
    """Qwen3-Next's mixture: 4 experts, top-2, a shared expert, layer 1 dense."""
    return shrink("qwen3-next-80b-a3b", **{**HYBRID, "num_experts": 4, "experts_per_token": 2, "moe_mlp_dim": 32,
                                          "shared_expert_dim": 48, "dense_layers": (1,), **overrides})


# The delta-net's decay parameters: each gradient a sum over every token of terms of both signs that nearly cancel,
# so the sharded model's other order of float32 sums moves it most: 4.9e-5 (relative to its largest entry) measured on
# data 2 x fsdp 2 x sp 2 before the delta-net's own backwards (the projections' one input-gradient GEMM, the gated
# norm's), 5.7e-5 after, 1.02e-4 with the tiled attention on fsdp 2 x sp 4. A wrong gradient is off by O(1).
GATES = {"a_log_U": 3e-4, "dt_bias_U": 3e-4}


@pytest.fixture(scope="module")
def plain():
    """The plain single-device results of each model, computed once when first asked for."""
    batch, results = packed_batch(0), {}

    def of(name):
        if name not in results:
            results[name] = run_model(build((hybrid if name == "dense" else hybrid_moe)(), "1dev", 0), batch)
        return results[name]

    return batch, of


# Each compiles the delta rule's forward and backward twice (about 100 s on 2 loaded cores): `make test-slow`. The
# default suite keeps the sublayer's gradients on fsdp 2 x sp 4 (tests/test_delta_net.py) and the families' parity.
CASES = [pytest.param(*case, marks=pytest.mark.slow) for case in (
    ("dense", "fsdp2xsp4", dict(remat="offload", mlp_chunk=4)),  # FSDP, layer inputs in host memory, tiled MLP
    ("moe", "fsdp2xsp4", dict(remat="full", mlp_chunk=4)),  # the experts and the shared expert chunk by chunk
    ("dense", "data2xfsdp2xsp2-zero3", dict(remat="full", remat_every=3)),  # ZeRO-3, one group of three layers
    ("moe", "sp4", dict()),
    # the gated attention layer in the tiled sublayer, one head per group (its KV head copied over sp 4)
    ("dense", "fsdp2xsp4", dict(remat="full", attn_chunk=4, attn_head_chunk=1)),
)]


@pytest.mark.parametrize("model, mesh_name, tools", CASES)
def test_sharded_and_memory_tools_equal_plain(plain, model, mesh_name, tools):
    batch, of = plain
    cfg = (hybrid if model == "dense" else hybrid_moe)(shard_params_over_data=MESHES[mesh_name][3], **tools)
    result = run_model(build(cfg, mesh_name, 0), batch)
    assert_same(result, of(model), GATES)
    grads = dict(nnx.to_flat_state(result[2]))
    for path, g in grads.items():  # each mixer stacked over its own layers (1 and 2 of 3), every row trained
        value = np.asarray(g.get_value())
        if path[:2] in (("blocks", "delta"), ("blocks", "attn")):
            assert len(value) == (2 if path[1] == "delta" else 1), path
            assert all(np.abs(row).max() > 0 for row in value), path


def test_one_scan_whatever_the_depth():
    """The traced forward has as many equations for 12 hybrid layers as for 4: one scan, a switch per layer."""
    def count(n):
        cfg = hybrid(num_layers=n)
        model = nnx.eval_shape(lambda: Transformer(cfg, mesh=make_mesh(devices=jax.devices()[:1]), rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(model)
        return len(jax.make_jaxpr(lambda st, t: nnx.merge(graphdef, st)(t))(state, jnp.zeros((1, 16), jnp.int32))
                   .jaxpr.eqns)

    assert count(4) == count(12)
    assert hybrid().kind_of_layer == (1, 0, 1) and hybrid().window_kinds == (None,)


@pytest.mark.parametrize("preset", ["qwen3.5-9b", "qwen3.5-0.8b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b",
                                    "tiny-hybrid"])
def test_each_layer_stores_its_own_mixer_only(preset):
    """Each token mixer is stacked over its own layers (``layer_kinds.mixer_layers``): the model stores exactly the
    parameters its card counts (``param_count``; before, every layer held both mixers: 21.8% more for Qwen3.5-9B), the
    attention's stack has the attention layers' rows and the delta-net's the linear layers'."""
    from ulysses_jax import ModelConfig
    from ulysses_jax.model.flops import param_count

    cfg = ModelConfig.from_preset(preset)
    model = nnx.eval_shape(lambda: Transformer(cfg, mesh=make_mesh(devices=jax.devices()[:1]), rngs=nnx.Rngs(0)))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == param_count(cfg)
    assert model.blocks.attn.wq_DNH.shape[0] == len(cfg.attention_layers) == cfg.num_layers // 4
    assert model.blocks.delta.wq_DJQ.shape[0] == len(cfg.linear_layers) == cfg.num_layers - cfg.num_layers // 4


def test_offloaded_layer_parameters_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^offload_params \(--offload-params\) streams each layer's parameters .* "
                                         r"train this model without --offload-params$"):
        hybrid(offload_params=True)


def test_an_automatic_sp_splits_the_delta_net_heads():
    """`--mesh.sp 0` takes the most devices of a host whose sp both attention and the delta-net's heads split over."""
    from ulysses_jax.train.devices import MeshConfig, build_mesh

    mesh = build_mesh(MeshConfig(sp=0), hybrid(linear_num_key_heads=2, linear_num_value_heads=4), 64)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "ring": 1, "sp": 4}  # 8 query heads, but 4 value heads
