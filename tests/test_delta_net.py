"""The gated delta-net sublayer under Ulysses (model/delta_net.py, parallel/ulysses_delta.py) against the whole
sublayer on one device with no exchange (projections, the short convolution, the token-by-token recurrence of
kernels/gated_delta_reference.py, the gated norm, the output projection): outputs and gradients on fsdp 2 x sp 4, key
heads split over sp or copied to it; packed rows against each document alone; the head layout and its refusals."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ulysses_jax as uj
from ulysses_jax.kernels.gated_delta import gates
from ulysses_jax.kernels.gated_delta_reference import gated_delta_recurrent
from ulysses_jax.kernels.short_conv import causal_conv1d
from ulysses_jax.model.config import PRESETS
from ulysses_jax.model.delta_net import DeltaNet, check_mesh, describe, gated_rms_norm
from ulysses_jax.model.layers import ParamMaker
from ulysses_jax.parallel.ulysses_delta import delta_exchange_bytes, plan_delta_heads

B, S, D = 2, 64, 32
# (key heads, value heads[, delta_head_chunk]): key heads split over sp = 4, fewer key heads than sp (each copied to 2
# devices); in head groups: two groups of one key head and its two value heads each, and two groups of one value head
# each sharing a key head (projected and exchanged once per group); key heads copied, the rule's walk over chunks in
# the Pallas kernels (interpret mode here; head dims 16, the smallest their products take)
HEADS = {"split": (4, 8), "copied": (2, 4), "groups": (8, 16, 2), "groups-shared-key": (4, 8, 1),
         "pallas": (2, 4, 0, "pallas")}


def config(hk, hv, m=0, impl="xla"):
    d = 16 if impl == "pallas" else 8
    return uj.ModelConfig(hidden=D, num_layers=1, layer_pattern=("linear",), linear_num_key_heads=hk,
                          linear_num_value_heads=hv, linear_key_head_dim=d, linear_value_head_dim=d,
                          compute_dtype="float32", init_std=0.3, delta_head_chunk=m, delta_impl=impl)


def make(cfg, mesh, seed=0):
    with nnx.use_eager_sharding(False):
        net = DeltaNet(ParamMaker(cfg, mesh, nnx.Rngs(seed)))
    params = nnx.state(net, nnx.Param)  # the filters and gates drawn anew: larger than the init, never zero
    r = np.random.default_rng(seed)
    for name in ("conv_q_JQC", "conv_k_JQC", "conv_v_UWC", "norm_W", "dt_bias_U"):
        var = params[name]
        var.set_value(jnp.asarray(r.normal(size=var.get_value().shape) * 0.5 + (name == "norm_W"), jnp.float32))
    nnx.update(net, params)
    return net


def reference(p, x, seg, cfg):
    """The sublayer on one device, no exchange: every channel convolved at once, the recurrence token by token."""
    q, k = (jnp.einsum("bsd,djq->bsjq", x, p[n]) for n in ("wq_DJQ", "wk_DJQ"))
    v, z = (jnp.einsum("bsd,duw->bsuw", x, p[n]) for n in ("wv_DUW", "wz_DUW"))
    b, a = (jnp.einsum("bsd,du->bsu", x, p[n]) for n in ("wb_DU", "wa_DU"))
    bs, s = x.shape[:2]
    flat = jnp.concatenate([q.reshape(bs, s, -1), k.reshape(bs, s, -1), v.reshape(bs, s, -1)], axis=-1)
    c = cfg.linear_conv_kernel
    w = jnp.concatenate([p[n].reshape(-1, c) for n in ("conv_q_JQC", "conv_k_JQC", "conv_v_UWC")])
    flat = causal_conv1d(flat, w, seg)
    q2, k2, v2 = jnp.split(flat, np.cumsum([q[0, 0].size, k[0, 0].size]), axis=-1)
    g, beta = gates(a, b, p["a_log_U"], p["dt_bias_U"])
    o = gated_delta_recurrent(q2.reshape(q.shape), k2.reshape(k.shape), v2.reshape(v.shape), g, beta,
                              segment_ids=seg)
    return jnp.einsum("bsuw,uwd->bsd", gated_rms_norm(o, z, p["norm_W"], cfg.rms_eps), p["wo_UWD"])


def close(got, want, tol, what=""):
    """``|got - want| <= tol * max|want|`` elementwise: float32 through a chunked rule against a token-by-token one."""
    got, want = np.asarray(got), np.asarray(want)
    scale = np.abs(want).max()
    assert scale > 0, what  # every output and gradient is nonzero: each part matters
    err = np.abs(got - want).max() / scale
    assert err <= tol, f"{what}: max error {err:.2e} of max |value| {scale:.3g}"


def packed_ids():
    """Three documents in row 0, crossing the devices' seams (16 tokens each), padding at the end of row 1."""
    row0 = np.repeat([1, 2, 3], [21, 27, 16])
    row1 = np.concatenate([np.full(50, 1), np.zeros(14, int)])
    return jnp.asarray(np.stack([row0, row1]), jnp.int32)


@pytest.fixture(scope="module", params=[pytest.param("copied"), pytest.param("split", marks=pytest.mark.slow),
                                        pytest.param("groups"), pytest.param("groups-shared-key",
                                                                             marks=pytest.mark.slow),
                                        pytest.param("pallas")])
def sharded(request):
    """The sublayer on fsdp 2 x sp 4 over packed rows: its parameters, input, output and gradients of
    ``sum(out * cot)`` (one compiled program, shared by the tests below)."""
    cfg = config(*HEADS[request.param])
    net = make(cfg, uj.make_mesh(fsdp=2, sp=4))
    graphdef, params = nnx.split(net, nnx.Param)
    r = np.random.default_rng(1)
    x = jnp.asarray(r.normal(size=(B, S, D)), jnp.float32)
    cot = jnp.asarray(r.normal(size=(B, S, D)), jnp.float32)
    seg = packed_ids()

    @jax.jit
    def ours(params, x):
        out, vjp = jax.vjp(lambda p, x: nnx.merge(graphdef, p)(x, seg), params, x)
        return out, vjp(cot)

    out, (g_params, g_x) = ours(params, x)
    flat = {k[0]: v.get_value() for k, v in nnx.to_flat_state(params)}
    grads = {k[0]: v.get_value() for k, v in nnx.to_flat_state(g_params)}
    return dict(cfg=cfg, flat=flat, x=x, cot=cot, seg=seg, out=out, g_x=g_x, grads=grads)


def test_sharded_sublayer_equals_one_device_outputs_and_gradients(sharded):
    cfg, flat, x, cot, seg = (sharded[k] for k in ("cfg", "flat", "x", "cot", "seg"))

    @jax.jit
    def ref(flat, x):
        out, vjp = jax.vjp(lambda f, x: reference(f, x, seg, cfg), flat, x)
        return out, vjp(cot)

    ref_out, (ref_g, ref_gx) = ref(flat, x)
    close(sharded["out"], ref_out, 2e-5, "output")
    close(sharded["g_x"], ref_gx, 1e-4, "input gradient")  # float32 sums in another order (5.1e-5 measured)
    for name, got in sharded["grads"].items():
        close(got, ref_g[name], 1e-4, f"gradient of {name}")


def test_packed_rows_equal_each_document_alone(sharded):
    """Each document of the packed rows run alone from its first token (then zeros, which a causal sublayer's earlier
    outputs never see), without segment ids, on one device."""
    x, seg = np.asarray(sharded["x"]), np.asarray(sharded["seg"])
    docs = [(row, np.flatnonzero(seg[row] == d)) for row in range(B) for d in np.unique(seg[row][seg[row] > 0])]
    alone = np.zeros((len(docs), S, D), np.float32)
    for i, (row, where) in enumerate(docs):
        alone[i, :len(where)] = x[row, where]
    ref = jax.jit(lambda f, x: reference(f, x, None, sharded["cfg"]))(sharded["flat"], jnp.asarray(alone))
    for i, (row, where) in enumerate(docs):
        close(np.asarray(sharded["out"])[row, where], ref[i, :len(where)], 2e-5, f"row {row}, tokens {where[0]}..")


def test_head_layout_and_refusals():
    assert plan_delta_heads(16, 32, 8).kl == 2 and not plan_delta_heads(16, 32, 8).copies_keys
    wide = plan_delta_heads(16, 32, 32)  # Qwen3.5-9B / Qwen3-Next on sp 32: one key head copied to two devices
    assert (wide.kl, wide.vl, wide.key_slots[:4]) == (1, 1, (0, 0, 1, 1))
    with pytest.raises(ValueError, match=r"16 key and 32 value heads .* use --mesh.sp one of 1, 2, 4, 8, 16, 32"):
        plan_delta_heads(16, 32, 64)
    with pytest.raises(ValueError, match="do not split over sp=3"):
        plan_delta_heads(2, 6, 3)
    assert delta_exchange_bytes(plan_delta_heads(2, 4, 4), batch=1, seq_len=64, dk=8, dv=8, itemsize=4) == {
        "qkvab": 16 * 4 * (2 * 8 + 8 + 2) * 4, "out": 16 * 4 * 8 * 4}
    cfg = config(*HEADS["copied"])
    with pytest.raises(ValueError, match=r"do not run with a ring \(--mesh.ring 2\)"):
        check_mesh(cfg, uj.make_mesh(fsdp=2, ring=2, sp=2))
    with pytest.raises(ValueError, match="layer_pattern has 'linear' .* set linear_num_key_heads"):
        uj.ModelConfig(layer_pattern=("linear", "global"))
    with pytest.raises(ValueError, match="must be a multiple of linear_num_key_heads"):
        uj.ModelConfig(layer_pattern=("linear",), linear_num_key_heads=3, linear_num_value_heads=4,
                       linear_key_head_dim=8, linear_value_head_dim=8)


def test_the_start_line_says_how_each_kind_of_layer_is_stored():
    """``describe``: Qwen3.5-9B's layers of each kind, its heads per device, and that each layer stores its own
    mixer's parameters (the attention stacked over 8 layers, the delta-net over 24)."""
    cfg = PRESETS["qwen3.5-9b"]
    line = describe(cfg, uj.make_mesh(sp=8, devices=jax.devices()[:8]))
    assert line.startswith("24 gated delta-net layers (linear attention: 16 key / 32 value heads of 128 / 128, 2 / 4 "
                           "per device on sp=8;"), line
    assert "and 8 full-attention layers (output-gated, RoPE on 64 of 256 dims)" in line, line
    assert line.endswith("each layer stores its own mixer's parameters only"), line
    assert (len(cfg.stacked_layers("attn")), len(cfg.stacked_layers("delta"))) == (8, 24)


def test_head_groups_are_laid_out_per_device_and_bad_ones_refused():
    """``group_heads``: each group's key and value heads device by device (the order the exchange hands them out);
    a group size that does not split a device's heads, or one on a model without delta-net layers, is refused."""
    from ulysses_jax.model.delta_net import group_heads

    keys, values = group_heads(config(8, 16, 2), 4)  # 2 key / 4 value heads per device: 2 groups of whole key heads
    np.testing.assert_array_equal(values, [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]])
    np.testing.assert_array_equal(keys, [[0, 2, 4, 6], [1, 3, 5, 7]])
    keys, values = group_heads(config(4, 8, 1), 4)  # one value head a group: the two of a key head share it
    np.testing.assert_array_equal(keys, [[0, 1, 2, 3], [0, 1, 2, 3]])
    np.testing.assert_array_equal(values, [[0, 2, 4, 6], [1, 3, 5, 7]])
    assert [len(x) for x in group_heads(config(2, 4), 4)] == [1, 1]  # 0: one group
    with pytest.raises(ValueError, match=r"delta_head_chunk \(3\) must divide the 4 delta-net value heads each device "
                                         r"computes \(sp=4\) .*; use one of 1, 2, 4"):
        check_mesh(config(8, 16, 3), uj.make_mesh(fsdp=2, sp=4))
    with pytest.raises(ValueError, match=r"delta_head_chunk \(2\) groups the heads of delta-net layers, but .* has "
                                         r"none; set it to 0"):
        uj.ModelConfig(delta_head_chunk=2)
    with pytest.raises(ValueError, match=r"delta_head_chunk \(-1\) must be 0 \(off\) or a positive number of "
                                         r"delta-net value heads"):
        config(8, 16, -1)


def test_head_groups_with_lora_adapters_equal_the_whole_sublayer():
    """LoRA on the delta-net (the fused q/k/v adapter, z's, out_proj's) in head groups: the same output and gradients
    (of the input and of every adapter) as the sublayer with all of a device's heads at once, on sp 4."""
    from ulysses_jax.model.lora_config import LoraConfig

    r, mesh = 2, uj.make_mesh(fsdp=2, sp=4)
    cfgs = [dataclasses.replace(config(8, 16, m), lora=LoraConfig(rank=r, targets=("in_proj_qkv", "in_proj_z",
                                                                                     "out_proj"))) for m in (0, 2)]
    rng = np.random.default_rng(3)
    f = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.3, jnp.float32)  # noqa: E731
    adapters = {"in_proj_qkv": (f(D, r), f(r, 2 * 8 * 8 + 16 * 8)), "in_proj_z": (f(D, r), f(r, 16, 8)),
                "out_proj": (f(16, 8, r), f(r, D))}
    x, cot, seg = f(B, S, D), f(B, S, D), packed_ids()
    results = []
    for cfg in cfgs:
        graphdef, params = nnx.split(make(cfg, mesh), nnx.Param)

        @jax.jit
        def run(params, x, adapters):
            out, vjp = jax.vjp(lambda x, ad: nnx.merge(graphdef, params)(x, seg, ad), x, adapters)
            return out, vjp(cot)

        results.append(run(params, x, adapters))
    (out0, (gx0, ga0)), (out1, (gx1, ga1)) = results
    close(out1, out0, 1e-5, "output")
    close(gx1, gx0, 1e-5, "input gradient")
    for name in adapters:
        for i in range(2):
            close(ga1[name][i], ga0[name][i], 1e-5, f"{name}'s {'AB'[i]} gradient")


def test_gated_norm_backward_equals_autodiff_of_its_formula():
    """``gated_rms_norm``'s own backward (float32 inside, its gradients rounded where made) against autodiff of
    ``rms_norm(o) * w * silu(z)`` written out, both in float32 on fresh inputs; and in bfloat16 against the float32
    formula within bfloat16's rounding."""
    rng = np.random.default_rng(7)
    o, z, dy = (rng.normal(size=(2, 16, 3, 8)) for _ in range(3))
    w = rng.normal(size=8) + 1.0

    def formula(o, z, w):
        n = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + 1e-6)
        return n * w * jax.nn.silu(z)

    def grads(fn, dtype):
        args = [jnp.asarray(a, dtype) for a in (o, z)] + [jnp.asarray(w, jnp.float32)]
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(jnp.asarray(dy, dtype))

    want_out, want = grads(formula, jnp.float32)
    got_out, got = grads(lambda o, z, w: gated_rms_norm(o, z, w, 1e-6), jnp.float32)
    close(got_out, want_out, 1e-6, "output")
    for name, g, h in zip(("o", "z", "w"), got, want):
        close(g, h, 1e-5, f"d{name}")
    got_out, got = grads(lambda o, z, w: gated_rms_norm(o, z, w, 1e-6), jnp.bfloat16)
    assert got[0].dtype == got[1].dtype == jnp.bfloat16 and got[2].dtype == jnp.float32
    for name, g, h in zip(("o", "z", "w"), got, want):
        close(np.asarray(g, np.float32), h, 2e-2, f"bf16 d{name}")


def test_the_input_gradient_is_one_gemm_in_the_compiled_h100_program():
    """``project``'s backward, compiled for a compile-only H100: one GEMM makes the gradient of the sublayer's input
    ``[S, D]`` from all six projections' gradients (autodiff made six, one per projection, and summed them: six
    ``[S/sp, D]`` arrays at once, what filled a device at Qwen3.5-9B's 8M tokens)."""
    import re

    from ulysses_jax.plan.targets import target_devices

    mesh = uj.make_mesh(fsdp=1, sp=1, devices=target_devices("h100", devices=1))
    cfg = dataclasses.replace(config(2, 4), hidden=192, linear_key_head_dim=64, linear_value_head_dim=64,
                              compute_dtype="bfloat16")
    with nnx.use_eager_sharding(False):
        net = nnx.eval_shape(lambda: DeltaNet(ParamMaker(cfg, mesh, nnx.Rngs(0))))
    graph, state = nnx.split(net)

    def loss(state, x):
        return jnp.sum(nnx.merge(graph, state)(x, None).astype(jnp.float32))

    x = jax.ShapeDtypeStruct((1, 2048, 192), jnp.bfloat16,
                             sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(state, x).lower().compile().as_text()
    made = re.compile(r"= bf16\[(1,)?2048,192\]\{[\d,]+\} (fusion|custom-call)")  # an [S, D] array from a kernel
    gemms = [line for line in text.splitlines()
             if made.search(line) and ("gemm" in line or "cublas" in line) and "transpose(" in line]
    assert len(gemms) == 1, gemms


def test_delta_precision_reaches_the_rule_and_bad_values_are_refused():
    """``delta_precision='bf16'`` (``--delta-precision``) runs the sublayer's rule on bf16 products: its output moves
    off the float32 one (so the setting reaches the kernel) by less than 2% of its largest value; a value other than
    the two, or 'bf16' on a model without delta-net layers, is refused in one line."""
    mesh = uj.make_mesh(fsdp=1, sp=1, devices=jax.devices()[:1])
    x = jnp.asarray(np.random.default_rng(3).normal(size=(B, S, D)), jnp.float32)
    outs = {}
    for precision in ("highest", "bf16"):
        net = make(dataclasses.replace(config(4, 8), delta_precision=precision), mesh)
        outs[precision] = np.asarray(net(x, None))
    err = np.abs(outs["bf16"] - outs["highest"]).max() / np.abs(outs["highest"]).max()
    assert 1e-6 < err < 2e-2, err
    with pytest.raises(ValueError, match=r"delta_impl 'triton' is not one of xla, pallas"):
        dataclasses.replace(config(4, 8), delta_impl="triton")
    with pytest.raises(ValueError, match=r"delta_impl \('pallas'\) sets the delta rule of delta-net layers, but "
                                         r".* has none; leave it at 'xla'"):
        uj.ModelConfig(delta_impl="pallas")
    with pytest.raises(ValueError, match=r"delta_precision 'fp16' is not one of highest, bf16"):
        dataclasses.replace(config(4, 8), delta_precision="fp16")
    with pytest.raises(ValueError, match=r"delta_precision \('bf16'\) sets the delta rule of delta-net layers, but "
                                         r".* has none; leave it at 'highest'"):
        uj.ModelConfig(delta_precision="bf16")


def test_the_cli_sets_the_delta_walk_and_refuses_others():
    """``train --delta-impl pallas`` reaches the model config (and is a compute-only setting: free on resume); an
    unknown walk is refused by the parser in one line naming the choices."""
    from ulysses_jax.cli import parse
    from ulysses_jax.train.config import model_config
    from ulysses_jax.train.runconfig import COMPUTE_ONLY

    cfg = parse(["train", "--preset", "tiny-hybrid", "--delta-impl", "pallas", "--delta-precision", "bf16"])
    model = model_config(cfg, 4096)
    assert (model.delta_impl, model.delta_precision) == ("pallas", "bf16")
    assert model_config(parse(["train", "--preset", "tiny-hybrid"]), 4096).delta_impl == "xla"
    assert {"delta_impl", "delta_precision"} <= set(COMPUTE_ONLY)
    with pytest.raises(ValueError, match=r"invalid choice 'triton' for argument '--delta-impl'. Expected one of "
                                         r"pallas, xla"):
        parse(["train", "--preset", "tiny-hybrid", "--delta-impl", "triton"])
