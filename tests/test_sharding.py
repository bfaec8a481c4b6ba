"""The logical-axis table and the parameter layout it gives: every parameter split at rest over fsdp x sp
(x data for ZeRO-3), born that way, with the same values on any mesh."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_model import MESHES, build, mesh_for, shrink

from ulysses_jax import LOGICAL_AXES, Transformer, format_param_table, param_shardings, param_table
from ulysses_jax.model.layers import sharded_init
from ulysses_jax.parallel.sharding import compute_spec, fsdp_axes, param_spec


def test_table():
    # each logical name once (a dict), each with an at-rest and a compute entry
    assert set(LOGICAL_AXES) == {"batch", "seq", "embed", "vocab", "heads", "kv_heads", "head_dim", "mlp", "experts",
                                 "layers", "linear_heads", "linear_dim", "conv"}  # the last three: the delta-net's
    assert param_spec(("experts", "embed", "mlp")) == P(None, ("fsdp", "ring", "sp"), None)  # experts gathered
    assert fsdp_axes() == ("fsdp", "ring", "sp") and fsdp_axes(over_data=True) == ("data", "fsdp", "ring", "sp")
    # at rest: only the embed dimension is split, over fsdp x ring x sp (x data)
    assert param_spec(("embed", "mlp")) == P(("fsdp", "ring", "sp"), None)
    assert param_spec(("mlp", "embed"), over_data=True) == P(None, ("data", "fsdp", "ring", "sp"))
    assert param_spec(("vocab", "embed")) == P(None, ("fsdp", "ring", "sp"))
    assert param_spec(("heads", "head_dim")) == P(None, None)
    # in compute: batch over data x fsdp, sequence over ring x sp (ring-major), parameters whole
    assert compute_spec(("batch", "seq", "embed")) == P(("data", "fsdp"), ("ring", "sp"), None)
    assert compute_spec(("batch", "seq", "heads", "head_dim")) == P(("data", "fsdp"), ("ring", "sp"), None, None)
    assert compute_spec(("embed", "mlp")) == P(None, None)
    with pytest.raises(ValueError, match=r"unknown logical axis 'hidden'"):
        param_spec(("hidden",))


CFG = shrink("qwen3-8b", num_kv_heads=4, qkv_bias=True)  # every kind of parameter: qk-norm, biases, untied head


@pytest.mark.parametrize("mesh_name", ["fsdp2xsp4", "data2xfsdp2xsp2-zero3"])
def test_every_parameter_split_at_rest(mesh_name):
    model = build(CFG, mesh_name, 0, perturb=False)
    print(f"\nparameters on {mesh_name}:\n{format_param_table(model)}")
    over_data = MESHES[mesh_name][3]
    split = 8 if over_data else 2 * 4  # devices that share one parameter's storage
    rows = param_table(model)
    assert len(rows) == 2 + 1 + (2 + 4 + 3 + 3 + 2)  # embed, head, final norm; the stacked layers' parameters
    arrays = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    for (path, shape, dtype, names, want, actual), array in zip(rows, arrays, strict=True):
        assert dtype == "float32" and array.shape == shape
        if path.startswith("blocks."):  # the scanned layers: a leading, unsplit "layers" axis
            assert names[0] == "layers" and shape[0] == CFG.num_layers and want[0] is None
        assert want == param_spec(names, over_data=over_data) and actual == array.sharding.spec
        assert array.sharding.is_equivalent_to(NamedSharding(model.mesh, want), len(shape)), path
        local = array.addressable_shards[0].data.shape
        if "embed" in names:
            axis = names.index("embed")
            assert want[axis] == fsdp_axes(over_data)
            assert local == shape[:axis] + (shape[axis] // split,) + shape[axis + 1 :], path
        else:  # only small per-head vectors are whole: q/k norm scales and q/k/v biases
            small = ("q_norm.scale", "k_norm.scale", "bq_NH", "bk_KH", "bv_KH")
            assert path.startswith("blocks.") and path.endswith(small), path
            assert local == shape
    # the shardings read back from metadata, from an abstract model (eval_shape drops array shardings)
    abstract = nnx.eval_shape(lambda: Transformer(model.config, mesh=model.mesh, rngs=nnx.Rngs(0)))
    from_metadata = jax.tree.leaves(param_shardings(abstract, model.mesh))
    actual = [x.sharding for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    assert len(from_metadata) == len(actual)
    for s, a in zip(from_metadata, actual):
        assert s.is_equivalent_to(a, len(s.spec) or 1)


def test_same_seed_same_parameters_on_any_mesh(seed):
    ref = jax.tree.leaves(nnx.state(build(CFG, "1dev", seed, perturb=False), nnx.Param))
    for mesh_name in ["fsdp8", "sp8", "fsdp2xsp4", "data2xfsdp2xsp2-zero3"]:
        got = jax.tree.leaves(nnx.state(build(CFG, mesh_name, seed, perturb=False), nnx.Param))
        for g, r in zip(got, ref, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
    other = jax.tree.leaves(nnx.state(build(CFG, "1dev", seed + 1, perturb=False), nnx.Param))
    random = [(np.asarray(o), np.asarray(r)) for o, r in zip(other, ref) if np.std(np.asarray(r)) > 0]
    assert random and not any(np.array_equal(o, r) for o, r in random)


def test_parameters_born_sharded():
    """The initializer of a parameter is one program whose per-device output is the shard: no device ever
    holds the whole array (neither as output nor as a temporary)."""
    mesh = mesh_for("fsdp2xsp4")
    shape, spec = (4096, 256), param_spec(("vocab", "embed"))
    init = sharded_init("normal", 0.02, shape, np.dtype("float32"), NamedSharding(mesh, spec))
    mem = init.lower(jax.random.key(0)).compile().memory_analysis()
    whole = 4096 * 256 * 4
    assert mem.output_size_in_bytes == whole // 8
    # temporaries: the shard's random bits and their float conversion, a few shard-sized buffers
    assert mem.temp_size_in_bytes <= 4 * whole // 8 < whole


def test_indivisible_parameter_is_a_clear_error():
    cfg = shrink("llama3.2-1b", hidden=60, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"parameter embed has shape \(256, 60\): dimension 60 must be divisible by"):
        Transformer(cfg, mesh=mesh_for("fsdp2xsp4"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"the mesh must have axes \('data', 'fsdp', 'ring', 'sp'\)"):
        Transformer(cfg, mesh=jax.make_mesh((8,), ("x",)), rngs=nnx.Rngs(0))
