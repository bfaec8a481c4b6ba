"""The NNX transformer on fake CPU devices: SP=P and FSDP x SP meshes equal the single-device model
(logits, loss, gradients), packed documents behave as separate documents, tiled MLP and remat policies
change memory, not results."""

import contextlib
import dataclasses
import functools
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import USERS_CPU_CODEGEN
from flax import nnx

from ulysses_jax import ModelConfig, Transformer, make_mesh, next_token_loss, shift_labels
from ulysses_jax.model.layers import document_positions, rope_frequencies
from ulysses_jax.model.transformer import remat_policy

B, S, V = 8, 64, 256
MESHES = {  # name -> (data, fsdp, sp, ZeRO-3 over data)
    "1dev": (1, 1, 1, False),
    "fsdp8": (1, 8, 1, False),
    "sp2": (1, 1, 2, False),
    "sp4": (1, 1, 4, False),
    "sp8": (1, 1, 8, False),
    "fsdp2xsp4": (1, 2, 4, False),
    "fsdp4xsp2": (1, 4, 2, False),
    "data2xfsdp2xsp2-zero3": (2, 2, 2, True),
    "data2xsp4": (2, 1, 4, False),  # replicas: parameters whole over data, their gradients summed over it
}


def shrink(preset: str, **overrides) -> ModelConfig:
    """A published preset's features (rope scaling, tying, qk-norm, bias) at CPU size, in float32."""
    small = dict(num_layers=2, hidden=64, num_heads=8, head_dim=8, mlp_dim=128, vocab_size=V, compute_dtype="float32")
    return ModelConfig.from_preset(preset, **{**small, **overrides})


VARIANTS = {
    "mha-bias": lambda: shrink("qwen2.5-0.5b", num_kv_heads=8),  # MHA, q/k/v bias, tied
    "gqa-llama3": lambda: shrink("llama3.2-1b", num_kv_heads=2),  # GQA 4:1, llama3 rope scaling, tied
    "gqa-qknorm": lambda: shrink("qwen3-8b", num_kv_heads=4, head_dim=16),  # qk-norm, N*H != D, untied
    # Qwen3.5's full-attention layers alone: the output gate, a quarter of each head rotated, qk-norm with (1 + w)
    "gated": lambda: shrink("qwen3.5-9b", layer_pattern=("global",), num_kv_heads=2, head_dim=16,
                            linear_num_key_heads=0, linear_num_value_heads=0, linear_key_head_dim=0,
                            linear_value_head_dim=0),
}


def mesh_for(name):
    data, fsdp, sp, _ = MESHES[name]
    return make_mesh(data=data, fsdp=fsdp, sp=sp, devices=jax.devices()[: data * fsdp * sp])


def build(cfg, mesh_name, seed, perturb=True):
    """The model for ``seed`` on a mesh. ``perturb``: every parameter shifted by seeded noise (added on the
    host, the same on any mesh) so that norm scales and biases are not trivially 1 and 0."""
    cfg = dataclasses.replace(cfg, shard_params_over_data=MESHES[mesh_name][3])
    model = Transformer(cfg, mesh=mesh_for(mesh_name), rngs=nnx.Rngs(seed))
    if perturb:
        rng = np.random.default_rng(seed)
        state = nnx.state(model, nnx.Param)
        leaves, treedef = jax.tree.flatten(state)
        noisy = [np.asarray(x) + 0.05 * rng.standard_normal(x.shape).astype(x.dtype) for x in leaves]
        nnx.update(model, jax.tree.unflatten(treedef, [jax.device_put(n, x.sharding) for n, x in zip(noisy, leaves)]))
    return model


def packed_batch(seed, b=B, s=S, n_docs=3, shard=None):
    """Random tokens in ``n_docs`` documents per row (no boundary on a multiple of ``shard``), labels shifted."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, (b, s), dtype=np.int32)
    cuts = np.sort(rng.choice(np.arange(1, s), (b, n_docs - 1)), axis=1)
    if shard:
        cuts = np.where(cuts % shard == 0, cuts + 1, cuts)
    seg = (np.arange(s)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(np.int32)
    tokens, seg = jnp.asarray(tokens), jnp.asarray(seg)
    return dict(tokens=tokens, labels=shift_labels(tokens, seg), segment_ids=seg)


# Tests compile many small programs; LLVM's optimisations halve the compile time and do not matter here.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
def run(graphdef, state, batch):
    """(logits, loss output, gradients of the loss) of ``nnx.merge(graphdef, state)``: one forward."""

    def loss_fn(state):
        model = nnx.merge(graphdef, state)
        hidden = model.hidden_states(batch["tokens"], None, batch["segment_ids"])
        out = next_token_loss(model, batch, hidden=hidden)
        return out.loss, (out, model.logits(hidden))

    (_, (out, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state)
    return logits, out, grads


def run_model(model, batch):
    return run(*nnx.split(model), batch)


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
def _forward(graphdef, state, tokens, positions, segment_ids):
    return nnx.merge(graphdef, state)(tokens, positions, segment_ids)


def forward(model, tokens, positions=None, segment_ids=None):
    return _forward(*nnx.split(model), tokens, positions, segment_ids)


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


# Tolerances (float32 everywhere): the sharded model sums in a different order (per-shard partial sums,
# all-reduces); measured differences are ~1e-7 relative. Loss: 1e-6 relative.
TOL_LOGITS, TOL_GRAD, TOL_LOSS = 1e-5, 1e-4, 1e-6


def assert_same(result, ref, tol_grad: dict | None = None):
    """``tol_grad``: a looser gradient tolerance for the parameters it names (the last part of their path)."""
    logits, out, grads = result
    ref_logits, ref_out, ref_grads = ref
    assert logits.dtype == jnp.float32 and logits.shape == ref_logits.shape
    assert rel_err(logits, ref_logits) < TOL_LOGITS
    assert int(out.count) == int(ref_out.count)
    np.testing.assert_allclose(float(out.loss), float(ref_out.loss), rtol=TOL_LOSS)
    flat, ref_flat = nnx.to_flat_state(grads), dict(nnx.to_flat_state(ref_grads))
    assert len(flat) == len(ref_flat)
    for path, g in flat:
        assert rel_err(g.get_value(), ref_flat[path].get_value()) < (tol_grad or {}).get(path[-1], TOL_GRAD), path


# Each mesh against the single-device model; the three variants rotate over the meshes.
CASES = [
    ("fsdp8", "gqa-llama3"),  # SP = 1, parameters split 8 ways
    ("sp2", "mha-bias"),
    ("sp4", "gqa-llama3"),
    ("sp8", "gqa-qknorm"),  # 4 KV heads on 8 devices: KV heads copied
    ("fsdp2xsp4", "mha-bias"),
    ("fsdp2xsp4", "gqa-llama3"),
    ("fsdp4xsp2", "gqa-qknorm"),
    ("data2xfsdp2xsp2-zero3", "gqa-llama3"),
]


@pytest.mark.parametrize("mesh_name, variant", CASES, ids=[f"{m}-{v}" for m, v in CASES])
def test_sharded_equals_single_device(mesh_name, variant, seed):
    cfg = VARIANTS[variant]()
    sp = MESHES[mesh_name][2]
    batch = packed_batch(seed, shard=S // sp)
    if sp > 1:  # documents cross shard boundaries
        bounds = np.arange(S // sp, S, S // sp)
        seg = np.asarray(batch["segment_ids"])
        assert np.any(seg[:, bounds - 1] == seg[:, bounds])
    ref = run_model(build(cfg, "1dev", seed), batch)
    assert_same(run_model(build(cfg, mesh_name, seed), batch), ref)


def test_packed_documents_equal_documents_alone(seed):
    """Each document's logits in a packed row (on sp=4) equal those of the document run alone."""
    cfg = VARIANTS["gqa-llama3"]()
    lengths = [20, 30, 14]  # boundaries at 20 and 50: inside the sp=4 shards [0,16) [16,32) [32,48) [48,64)
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, V, n, dtype=np.int32) for n in lengths]
    packed = jnp.asarray(np.concatenate(docs))[None]
    seg = jnp.asarray(np.repeat(np.arange(3), lengths), jnp.int32)[None]
    sharded = build(cfg, "sp4", seed, perturb=False)
    packed_logits = forward(sharded, packed, segment_ids=seg)
    # alone: one document per row, padded at the end (causal: padding after a token cannot change it)
    alone = jnp.asarray(np.stack([np.pad(d, (0, S - len(d))) for d in docs]))
    alone_logits = forward(build(cfg, "1dev", seed, perturb=False), alone)
    start = 0
    for i, n in enumerate(lengths):
        got, want = packed_logits[0, start : start + n], alone_logits[i, :n]
        assert rel_err(got, want) < TOL_LOGITS, f"document {i}"
        start += n


def test_default_positions():
    seg = jnp.asarray([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 7, 7]], jnp.int32)
    np.testing.assert_array_equal(document_positions(seg), [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1]])
    cfg = VARIANTS["gqa-qknorm"]()
    model = build(cfg, "sp2", 0)
    batch = packed_batch(1, b=2, s=16)
    tok, seg = batch["tokens"], batch["segment_ids"]
    np.testing.assert_array_equal(forward(model, tok, None, seg), forward(model, tok, document_positions(seg), seg))
    arange = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
    np.testing.assert_array_equal(forward(model, tok), forward(model, tok, arange))
    # the model also runs un-jitted (op by op, shard_map eagerly)
    assert rel_err(model(tok, segment_ids=seg), forward(model, tok, segment_ids=seg)) < TOL_LOGITS


def test_rope_llama3_scaling_against_scalar_formula():
    """Llama-3 scaling, written per frequency as in Meta's reference: long wavelengths / factor,
    short ones kept, a linear blend of 1/factor and 1 in between."""
    cfg = ModelConfig.from_preset("llama3.2-1b")
    sc = cfg.rope_scaling
    got = rope_frequencies(cfg)
    for i, f in enumerate(1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim)):
        wavelen = 2 * np.pi / f
        if wavelen < sc.original_max_position / sc.high_freq_factor:
            want = f
        elif wavelen > sc.original_max_position / sc.low_freq_factor:
            want = f / sc.factor
        else:
            t = (sc.original_max_position / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
            want = (1 - t) * f / sc.factor + t * f
        assert got[i] == pytest.approx(want, rel=1e-12)
    assert got[0] == 1.0 and got[-1] < 1.0 / cfg.rope_theta ** ((cfg.head_dim - 2) / cfg.head_dim)
    assert np.array_equal(rope_frequencies(ModelConfig.from_preset("qwen3-8b"))[:1], [1.0])


@pytest.mark.parametrize("mesh_name", ["sp4", "data2xfsdp2xsp2-zero3", "data2xsp4"])
def test_tiled_mlp_equals_plain(mesh_name, seed):
    cfg = VARIANTS["gqa-qknorm"]()
    batch = packed_batch(seed)
    plain = run_model(build(cfg, mesh_name, seed), batch)
    # local sequence 64 / sp: chunks of 4 tokens -> 4 (sp4) or 8 (sp2) chunks per device
    tiled = run_model(build(dataclasses.replace(cfg, mlp_chunk=4), mesh_name, seed), batch)
    assert_same(tiled, plain)


@pytest.mark.parametrize("variant,mesh_name,impl,remat", [
    ("gqa-qknorm", "sp4", "blockwise", "none"),  # qk-norm, untied; 16 local tokens in 4 chunks
    ("mha-bias", "data2xfsdp2xsp2-zero3", "xla", "full"),  # q/k/v bias, ZeRO-3: 32 local tokens in 8 chunks, remat
    ("gqa-llama3", "sp8", "pallas", "none"),  # 2 KV heads on 8 devices (each copied to 4), Pallas (interpret)
    ("gqa-llama3", "fsdp2xsp4", "blockwise", "offload"),  # FSDP, layer inputs in host memory
    ("gqa-qknorm", "data2xsp4", "blockwise", "none"),  # replicas
])
def test_tiled_attention_equals_plain(variant, mesh_name, impl, remat, seed):
    """attn_chunk: the norm, projections and both all-to-alls chunk by chunk around one kernel call, with its own
    backward: the same logits, loss and gradients as the plain sublayer, on packed documents."""
    cfg = dataclasses.replace(VARIANTS[variant](), attention_impl=impl, remat=remat)
    batch = packed_batch(seed)
    plain = run_model(build(cfg, mesh_name, seed), batch)
    assert_same(run_model(build(dataclasses.replace(cfg, attn_chunk=4), mesh_name, seed), batch), plain)


@pytest.mark.parametrize("variant,mesh_name,impl,remat,head_chunk,recompute", [
    ("gqa-llama3", "1dev", "blockwise", "none", 1, False),  # 8 heads, 2 KV heads on one device: 8 groups sharing KV
    ("gqa-llama3", "1dev", "xla", "full", 4, True),  # 2 groups of one KV head each, remat, output recomputed
    ("gqa-qknorm", "sp2", "pallas", "none", 2, True),  # qk-norm; 4 heads, 2 KV per device: one KV head per group
    ("mha-bias", "fsdp2xsp4", "blockwise", "offload", 1, False),  # q/k/v bias, FSDP, layer inputs in host memory
    pytest.param("gqa-llama3", "sp8", "xla", "none", 1, False,  # 1 head per device, its KV head copied: one group
                 marks=pytest.mark.slow),  # 19 s; KV heads copied over sp are in the gated rows below too
    ("gqa-qknorm", "data2xfsdp2xsp2-zero3", "blockwise", "full", 1, True),  # ZeRO-3, replicas, 4 groups of one head
    ("gqa-qknorm", "sp4", "blockwise", "none", 0, True),  # one group, output recomputed
    # the output gate: per group in slot order (KV heads copied over sp 4), its gradient through its own projection
    ("gated", "fsdp2xsp4", "blockwise", "full", 1, False),
    ("gated", "sp2", "xla", "none", 2, True),  # groups added up as they finish, each gated in its slot order
])
def test_tiled_attention_head_groups_equal_plain(variant, mesh_name, impl, remat, head_chunk, recompute, seed):
    """attn_head_chunk: each group of a device's heads projected, exchanged and run through the kernel alone, with
    the weights cut per group (dummy and copied heads included); attn_recompute: no output kept for the backward.
    The logits, loss and gradients of the plain sublayer."""
    cfg = dataclasses.replace(VARIANTS[variant](), attention_impl=impl, remat=remat)
    batch = packed_batch(seed)
    plain = run_model(build(cfg, mesh_name, seed), batch)
    tiled = dataclasses.replace(cfg, attn_chunk=4, attn_head_chunk=head_chunk, attn_recompute=recompute)
    assert_same(run_model(build(tiled, mesh_name, seed), batch), plain)


def test_tiled_attention_head_chunk_that_does_not_fit_is_refused(seed):
    cfg = dataclasses.replace(VARIANTS["gqa-llama3"](), attn_chunk=4, attn_head_chunk=3)
    model = Transformer(cfg, mesh=mesh_for("sp2"), rngs=nnx.Rngs(seed))
    with pytest.raises(ValueError, match=r"attn_head_chunk \(3\) must divide the 4 query heads each device computes "
                                         r"\(8 heads, 2 KV heads over sp=2\) .* choose one of 1, 2, 4, or 0"):
        model(jnp.zeros((1, 64), jnp.int32))
    with pytest.raises(ValueError, match=r"attn_head_chunk \(2\) groups the heads of the tiled attention sublayer; "
                                         r"set attn_chunk too"):
        dataclasses.replace(cfg, attn_chunk=0, attn_head_chunk=2)


def test_tiled_attention_refuses_a_ring_and_a_chunk_that_does_not_divide(seed):
    cfg = dataclasses.replace(VARIANTS["gqa-llama3"](), attn_chunk=4)
    ring = Transformer(cfg, mesh=make_mesh(fsdp=1, ring=2, sp=4), rngs=nnx.Rngs(seed))
    with pytest.raises(ValueError, match=r"attn_chunk \(4\) tiles the Ulysses exchange of a mesh without a ring, but "
                                         r"this mesh has ring = 2; set attn_chunk to 0 with a ring"):
        ring(jnp.zeros((1, 64), jnp.int32))
    odd = Transformer(dataclasses.replace(cfg, attn_chunk=5), mesh=mesh_for("sp4"), rngs=nnx.Rngs(seed))
    with pytest.raises(ValueError, match=r"attn_chunk \(5\) must divide the per-device sequence length \(16 = "):
        odd(jnp.zeros((1, 64), jnp.int32))


def assert_gathers_only_parameters(hlo_text, model):
    """Every float all-gather in the compiled HLO has the shape of a parameter (or of one layer's slice of a
    stacked one): FSDP gathers, never activations."""
    allowed = set()
    for x in jax.tree.leaves(nnx.state(model, nnx.Param)):
        allowed |= {tuple(x.shape), tuple(x.shape[1:]), (1, *x.shape[1:])}
    gathered = [line.split("=", 1)[1].split(" all-gather(")[0].strip()
                for line in hlo_text.splitlines() if " all-gather(" in line and "=" in line]
    floats = [g for g in gathered if g.startswith("f32")]
    assert floats
    for g in floats:
        dims = tuple(int(d) for d in re.match(r"f32\[([\d,]*)\]", g).group(1).split(",") if d)
        assert dims in allowed, f"all-gather of a non-parameter {g}"


def test_tiled_mlp_moves_no_activation(seed):
    """Chunking the MLP happens on each device's local sequence: the only float all-gathers in the
    compiled step are those of parameters (the FSDP gathers), never of activations."""
    cfg = dataclasses.replace(VARIANTS["gqa-llama3"](), mlp_chunk=4)
    model = build(cfg, "fsdp2xsp4", seed)
    hlo = run.lower(*nnx.split(model), packed_batch(seed)).compile().as_text()
    assert_gathers_only_parameters(hlo, model)


@pytest.mark.parametrize("policy", ["full", "save_matmuls", "offload"])
def test_remat_policies_same_gradients(policy, seed):
    cfg = VARIANTS["gqa-llama3"]()
    batch = packed_batch(seed)
    plain = run_model(build(cfg, "fsdp2xsp4", seed), batch)
    assert_same(run_model(build(dataclasses.replace(cfg, remat=policy), "fsdp2xsp4", seed), batch), plain)


@pytest.mark.parametrize("policy", ["full", "offload"])
def test_remat_every_second_layer_same_gradients(policy, seed):
    """remat_every=2: the input of every second layer is kept, each pair of layers re-run: same loss and gradients."""
    cfg = dataclasses.replace(VARIANTS["gqa-llama3"](), num_layers=4)
    batch = packed_batch(seed)
    plain = run_model(build(cfg, "fsdp2xsp4", seed), batch)
    assert_same(run_model(build(dataclasses.replace(cfg, remat=policy, remat_every=2), "fsdp2xsp4", seed), batch),
                plain)


def test_remat_nested_same_gradients(seed):
    """remat_nested: a group's backward offloads its layers' inputs too: same loss and gradients."""
    cfg = dataclasses.replace(VARIANTS["gqa-llama3"](), num_layers=4)
    batch = packed_batch(seed)
    plain = run_model(build(cfg, "fsdp2xsp4", seed), batch)
    nested = dataclasses.replace(cfg, remat="offload", remat_every=2, remat_nested=True)
    assert_same(run_model(build(nested, "fsdp2xsp4", seed), batch), plain)
    with pytest.raises(ValueError, match="remat_nested .* needs remat='offload'"):
        dataclasses.replace(cfg, remat="full", remat_every=2, remat_nested=True)


# remat_every 2 (the loop over groups unrolled; 31 s) in make test-slow: the layer loop of save_matmuls (the flags timed
# on the H200) keeps the check in the default suite
@pytest.mark.parametrize("model,remat,every", [("gqa-llama3", "save_matmuls", 1),
                                               pytest.param("gqa-llama3", "full", 2, marks=pytest.mark.slow),
                                               pytest.param("tiny-hybrid", "full", 2, marks=pytest.mark.slow)])  # 52 s
def test_unrolled_layer_loop_same_gradients_and_no_stacked_saves(model, remat, every, seed):
    """scan_unroll (--scan-unroll): the same loss and gradients as the scanned layers (a hybrid too: its per-layer
    switch and the mixers stacked over their own layers, read by row); the compiled step runs no loop over the layers
    (or groups) and writes no slice of a stacked buffer (the scan writes each layer's saved values into one); refused
    with offload_params, which streams the scanned layers in one at a time."""
    base = VARIANTS[model]() if model in VARIANTS else ModelConfig.from_preset(model, vocab_size=V, max_seq_len=S)
    cfg = dataclasses.replace(base, num_layers=4, remat=remat, remat_every=every)
    batch, results = packed_batch(seed), {}
    for unroll in (False, True):
        model_ = build(dataclasses.replace(cfg, scan_unroll=unroll), "fsdp2xsp4", seed)
        if not cfg.linear_layers:  # (the delta rule's own loops may run as many trips as the layer groups)
            hlo = run.lower(*nnx.split(model_), batch).compile(USERS_CPU_CODEGEN).as_text()
            trips = re.findall(r'"known_trip_count":\{"n":"(\d+)"', hlo)
            layer_loop = str(cfg.num_layers // every) in trips
            assert layer_loop != unroll and ("dynamic-update-slice(" in hlo) != unroll, (unroll, trips)
        results[unroll] = run_model(model_, batch)
    assert_same(results[True], results[False])
    if not cfg.linear_layers:  # (a hybrid refuses offload_params on its own)
        with pytest.raises(ValueError, match=r"scan_unroll \(--scan-unroll\) unrolls the layer loop, which "
                                             r"offload_params"):
            dataclasses.replace(cfg, remat="offload", remat_every=1, offload_params=True, scan_unroll=True)


@pytest.mark.parametrize("model", ["gqa-llama3", pytest.param("tiny-hybrid", marks=pytest.mark.slow)])  # 35 s
def test_mlp_keep_saves_the_gate_and_up_products_with_the_same_gradients(model, seed):
    """mlp_keep (--mlp-keep) with remat full: each layer's MLP gate and up products are saved (two [L, B, S, F]
    residuals more than --attn-keep alone), so the backward runs none of the MLP's GEMMs again; the same loss and
    gradients as without remat (a hybrid's delta-net layers too); refused, in one line each, where it has nothing to
    keep or another tool keeps or re-runs the products."""
    base = VARIANTS[model]() if model in VARIANTS else ModelConfig.from_preset(model, vocab_size=V, max_seq_len=S)
    cfg = dataclasses.replace(base, num_layers=4, remat="full", attn_keep=True)
    wide = f"f32[{cfg.num_layers},{B},{S},{cfg.mlp_dim}]"
    kept = dataclasses.replace(cfg, mlp_keep=True)
    assert saved_residuals(cfg, seed).count(wide) == 0 and saved_residuals(kept, seed).count(wide) == 2
    batch = packed_batch(seed)
    assert_same(run_model(build(kept, "fsdp2xsp4", seed), batch),
                run_model(build(dataclasses.replace(cfg, remat="none", attn_keep=False), "fsdp2xsp4", seed), batch))
    for fields, why in ((dict(remat="none", attn_keep=False), "has nothing to keep without remat"),
                        (dict(remat="save_matmuls"), "is part of remat save_matmuls"),
                        (dict(remat="offload"), "keeps the products on the device, for remat full"),
                        (dict(mlp_chunk=16), r"set mlp_chunk \(--mlp-chunk\) to 0"),
                        (dict(remat_every=2), "use remat_every 1")):
        with pytest.raises(ValueError, match=rf"^mlp_keep \(--mlp-keep\) .*{why}"):
            dataclasses.replace(kept, **fields)
    with pytest.raises(ValueError, match=r"^mlp_keep \(--mlp-keep\) keeps a dense MLP's products, not routed"):
        dataclasses.replace(ModelConfig.from_preset("tiny-moe"), remat="full", mlp_keep=True)


def saved_residuals(cfg, seed) -> list[str]:
    """Type and shape (``f32<host>[L,B,S,D]``) of each residual the loss's backward saves, on sp=2."""
    graphdef, state = nnx.split(build(cfg, "sp2", seed))
    batch = packed_batch(seed)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(
            lambda st: next_token_loss(nnx.merge(graphdef, st), batch).loss, state
        )
    return [line.split()[0] for line in out.getvalue().splitlines()]


def test_remat_every_k_offloads_one_input_per_group(seed):
    """remat='offload', remat_every=2: host memory holds L/2 saved layer inputs, not L."""
    cfg = dataclasses.replace(VARIANTS["gqa-llama3"](), num_layers=4, remat="offload", remat_every=2)
    saved = saved_residuals(cfg, seed)
    assert f"f32<host>[2,{B},{S},{cfg.hidden}]" in saved, saved
    assert not any(s.startswith(f"f32<host>[{cfg.num_layers},") or s == f"f32[4,{B},{S},{cfg.hidden}]"
                   for s in saved), saved
    with pytest.raises(ValueError, match=r"remat_every \(3\) must be a positive divisor of num_layers \(4\)"):
        dataclasses.replace(cfg, remat_every=3)


def test_offload_puts_the_residual_stream_in_host_memory(seed):
    """remat='offload': each block's input is saved in pinned host memory, not on the device."""
    cfg = dataclasses.replace(VARIANTS["gqa-llama3"](), remat="offload")
    # the layer scan stacks the saved block inputs: one [L, B, S, D] residual, in host memory
    saved = saved_residuals(cfg, seed)
    assert f"f32<host>[{cfg.num_layers},{B},{S},{cfg.hidden}]" in saved, saved
    assert f"f32[{cfg.num_layers},{B},{S},{cfg.hidden}]" not in saved


def test_offload_without_host_memory_is_a_clear_error():
    class Memory:
        kind = "device"

    class Device:
        platform = "fake"

        def addressable_memories(self):
            return [Memory()]

    class Mesh:
        devices = np.array([Device()])

    with pytest.raises(ValueError, match=r"remat='offload' needs the 'pinned_host' memory kind.*use remat='full'"):
        remat_policy("offload", Mesh())


def test_batch_not_divisible_is_a_clear_error():
    model = build(VARIANTS["gqa-llama3"](), "fsdp2xsp4", 0)
    with pytest.raises(ValueError, match=r"batch size \(3\) must be divisible by data x fsdp = 1 x 2 = 2"):
        model(jnp.zeros((3, S), jnp.int32))
    with pytest.raises(ValueError, match=r"sequence length \(30\) must be divisible by sp \(4\)"):
        model(jnp.zeros((2, 30), jnp.int32))
    with pytest.raises(ValueError, match=r"segment_ids shape \(2, 32\) must equal the tokens' \(2, 64\)"):
        model(jnp.zeros((2, S), jnp.int32), segment_ids=jnp.zeros((2, 32), jnp.int32))


def test_bf16_compute_gives_float32_logits(seed):
    cfg = dataclasses.replace(VARIANTS["gqa-qknorm"](), compute_dtype="bfloat16")
    model = build(cfg, "sp2", seed)
    batch = packed_batch(seed, b=2)
    logits = forward(model, batch["tokens"])
    ref = forward(build(VARIANTS["gqa-qknorm"](), "1dev", seed), batch["tokens"])
    assert logits.dtype == jnp.float32
    assert rel_err(logits, ref) < 5e-2  # bf16 activations: 8 mantissa bits through 2 layers
