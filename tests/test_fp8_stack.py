"""Full fine-tuning with --fp8 on unsplit weights (``model/fp8_stack.py``): each projection stack quantised once a step
before the layer loop, in both layouts, against the path that quantised each layer inside the loop (bit for bit), where
it applies, and the compiled program for a compile-only H100 (no stacked parameter copied into another layout)."""

from __future__ import annotations

import dataclasses
import functools
from unittest import mock

import jax
import numpy as np
import pytest
from flax import nnx
from test_fp8 import (
    BASE,
    FAST,
    HYBRID,
    a_draw_flips_no_rounding,
    assert_float8_noise,
    batch,
    build,
    compiled_step,
    flat,
    max_rel,
)
from test_kept_attention import _count

from ulysses_jax import make_mesh
from ulysses_jax.model import fp8, fp8_stack
from ulysses_jax.model.lora_config import LoraConfig
from ulysses_jax.train.step import _loss_sums


def _loss_and_grads_of(graphdef, state, b, hoisted: bool):
    """``(mean loss, (gradients, the histories' new values or None))``; ``hoisted=False``: each layer's weights
    quantised inside the loop, as before ``fp8_stack`` (its ``modules`` patched to none while tracing)."""
    rest, hist = fp8.split(state)
    f = lambda p, h: _loss_sums(graphdef, fp8.join(p, h), b)  # noqa: E731
    with mock.patch.object(fp8_stack, "modules", fp8_stack.modules if hoisted else (lambda cfg, mesh: ())):
        (total, sums), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(rest, hist)
    return total / sums["count"], grads


_loss_and_grads = jax.jit(_loss_and_grads_of, static_argnums=(0, 3), compiler_options=FAST)


def _float8_transposes(jaxpr) -> int:
    """Transposes with a float8 result in a jaxpr, its sub-jaxprs included (the stacks' second layout)."""
    return _count(jaxpr, "transpose", lambda eqn: eqn.outvars[0].aval.dtype == fp8.E4M3)


# one device, the plain sublayers; data parallelism (2 x 1) with the tiled MLP, the tiled attention in head groups
# (q, k, v, o hoisted in one layout), remat and the delayed recipe; Gemma 3's mixed window kinds; a hybrid (its
# attention stacked over its one attention layer, its delta-net over two: both read by row)
@pytest.mark.parametrize("recipe, devices, fields", [
    ("current", 1, {}),
    ("delayed", 2, dict(mlp_chunk=16, attn_chunk=32, attn_head_chunk=2, remat="full")),
    pytest.param("current", 1, dict(sliding_window=16, layer_pattern=("local", "global"), post_norms=True,
                                    mlp_chunk=32), marks=pytest.mark.slow),  # 22 s; stacks read by row: hybrid-delayed
    ("delayed", 1, dict(HYBRID, num_layers=3, layer_pattern=("linear", "global", "linear"), remat="full")),
], ids=["plain", "dp2-tiled-delayed", "mixed-kinds", "hybrid-delayed"])
def test_the_stacks_quantised_before_the_loop_give_the_loops_values(recipe, devices, fields, seed):
    """Loss, every gradient and the delayed recipe's new histories equal those of quantising each layer inside the
    loop, bit for bit (the same scales, the same float8 values; the forward reads the transposed copy), unless the two
    programs sum a gradient in other orders: 1 of 150 seeds of the hybrid (2026-11-29, seed 7212: the MLP norm's scale
    2.2e-6 of its largest element apart, all else equal), none of 150 of each of the first two cases. Every draw is
    held to float8's noise (loss 1e-3, cosine 0.95, norm within 10%), the first that sums alike to bit for bit
    (``test_fp8.a_draw_flips_no_rounding``)."""
    cfg = dataclasses.replace(BASE, fp8=True, fp8_recipe=recipe, **fields)
    mesh = make_mesh(data=devices, fsdp=1, sp=1, devices=jax.devices()[:devices])
    mods = fp8_stack.modules(cfg, mesh)
    assert mods == (("attn", "delta", "mlp") if cfg.linear_layers else ("attn", "mlp"))
    # the stacks kept in both layouts: the delta-net's q, k, v, z side by side and its output; the tiled attention: none
    stacks = {"attn": 0 if cfg.attn_chunk else 4, "delta": 2, "mlp": 3}
    stacks = sum(stacks[m] for m in mods)
    graphdef, state = nnx.split(build(cfg, mesh, seed))
    transposes = [_float8_transposes(jax.make_jaxpr(functools.partial(_loss_and_grads_of, graphdef, hoisted=h))(
        state, batch(seed, b=2 * devices)).jaxpr) for h in (False, True)]
    # the two paths differ: one per stack (and, through the tiled MLP's shard_map, the transpose of its zero cotangent)
    assert transposes[0] == 0 and transposes[1] >= stacks, transposes

    def compare(s):
        model = (graphdef, state) if s == seed else nnx.split(build(cfg, mesh, s))  # the first draw's: built above
        b = batch(s, b=2 * devices)
        (l0, (g0, h0)), (l1, (g1, h1)) = (_loss_and_grads(*model, b, hoisted) for hoisted in (False, True))
        f0, f1 = flat(g0), flat(g1)
        assert f0.keys() == f1.keys()
        loss = abs(float(l1) / float(l0) - 1)
        assert loss < 1e-3, loss
        assert_float8_noise(f1, f0)
        apart = {str(k): max_rel(f1[k], f0[k]) for k in f0 if not np.array_equal(f0[k], f1[k])}
        if recipe == "delayed":
            new0, new1 = flat(h0), flat(h1)
            apart.update({f"history {k}": "apart" for k in new0 if not np.array_equal(new0[k], new1[k])})
        return float(l0) == float(l1) and not apart, {"loss": loss, **apart}

    a_draw_flips_no_rounding(compare, seed)


def test_where_the_stacks_are_quantised_before_the_loop():
    """Unsplit weights under --fp8 only: not without it, not with LoRA (its base rests in float8), --offload-params,
    FSDP or sequence devices (the weights split: each layer's gather moves float8) or experts; the delta-net in head
    groups keeps its own quantisation (each group its own scale)."""
    one = make_mesh(fsdp=1, sp=1, devices=jax.devices()[:1])
    on = dataclasses.replace(BASE, fp8=True)
    assert fp8_stack.modules(on, one) == ("attn", "mlp")
    assert fp8_stack.modules(on, make_mesh(data=8, fsdp=1, sp=1)) == ("attn", "mlp")
    assert fp8_stack.modules(dataclasses.replace(on, attn_chunk=32), one) == ("attn", "mlp")
    for cfg, mesh in [(BASE, one), (dataclasses.replace(on, lora=LoraConfig(rank=4, alpha=8.0)), one),
                      (dataclasses.replace(on, offload_params=True), one), (on, make_mesh(fsdp=2, sp=4)),
                      (on, make_mesh(data=4, fsdp=1, sp=2)),
                      (dataclasses.replace(on, shard_params_over_data=True), make_mesh(data=8, fsdp=1, sp=1))]:
        assert fp8_stack.modules(cfg, mesh) == (), (cfg, mesh.shape)
    assert fp8_stack.modules(dataclasses.replace(on, **HYBRID), one) == ("attn", "delta", "mlp")
    linear_only = dataclasses.replace(on, **dict(HYBRID, layer_pattern=("linear",)))
    assert fp8_stack.modules(linear_only, one) == ("delta", "mlp")
    assert fp8_stack.modules(dataclasses.replace(on, **HYBRID, delta_head_chunk=2), one) == ("attn", "mlp")


@pytest.mark.aot
@pytest.mark.parametrize("model", ["plain", pytest.param("hybrid", marks=pytest.mark.slow),  # 20 s more each:
                                   pytest.param("tiled", marks=pytest.mark.slow)])  # make test-slow
def test_the_h100_program_copies_no_stacked_weight(model):
    """Full fine-tuning with --fp8 on one compile-only H100 (float32 parameters, remat full, 4 layers): no stacked
    projection weight is copied into another layout (before: all seven, in float32, each step: 31.7 MiB of temporary
    memory against bf16's 23.0 here; llama3.2-1b at 32K: 3.62 GiB; a hybrid of 3 delta-net layers and 1 attention
    layer: all twelve stacks, 34.5 MiB against 30.1; the tiled attention, --attn-chunk 256: its four, 30.6 MiB against
    23.5); the step holds no more than bf16's step and the two float8 copies of each stack."""
    from ulysses_jax.model.flops import layer_matmul_params
    from ulysses_jax.plan import hlo

    kinds = {"plain": {}, "tiled": dict(attn_chunk=256),
             "hybrid": dict(HYBRID, layer_pattern=("linear", "linear", "linear", "global"))}[model]
    cfg = dataclasses.replace(BASE, hidden=256, num_heads=4, num_kv_heads=2, head_dim=64, mlp_dim=768,
                              attention_impl="cudnn", fp8=True, remat="full", param_dtype="float32",
                              **{**kinds, "num_layers": 4})
    hoisted, bf16 = (compiled_step(c, devices=1, fsdp=1, batch_size=1, seq_len=512)
                     for c in (cfg, dataclasses.replace(cfg, fp8=False)))
    assert hlo.parameter_copies(hoisted.as_text()) == []
    stacks = 2 * cfg.num_layers * layer_matmul_params(cfg)  # q and qt: one byte an element each
    temp = [c.memory_analysis().temp_size_in_bytes for c in (hoisted, bf16)]
    assert temp[0] <= temp[1] + stacks, (temp, stacks)
