"""Attention's forward run once under remat (``ModelConfig.attn_keep``, ``parallel/kept.py``): the same loss and
gradients as without it, on CPU with every kernel that has a CPU path; and in the program compiled for H100s, one
attention forward per layer where plain remat runs two (three with --remat-every 2). A hybrid keeps its delta-net's
output and rule states too: the same gradients, and the rule's forward once per layer in the compiled program."""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from np_reference import rel_err

from ulysses_jax import ModelConfig, Transformer, make_mesh, next_token_loss, shift_labels
from ulysses_jax.train.devices import MeshConfig


def _loss_and_grads(cfg, mesh, batch, seed):
    graphdef, state = nnx.split(Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(seed)))
    f = jax.jit(jax.value_and_grad(lambda st: next_token_loss(nnx.merge(graphdef, st), batch).loss))
    return f(state)


@pytest.mark.parametrize("impl,remat,every", [("blockwise", "full", 1), ("xla", "offload", 1),
                                              ("pallas", "full", 2), ("blockwise", "offload", 2)])
def test_kept_attention_gives_the_same_loss_and_gradients(impl, remat, every, seed):
    mesh = make_mesh(fsdp=2, sp=4)
    base = ModelConfig.from_preset("tiny", num_layers=2, hidden=64, num_heads=8, num_kv_heads=4, head_dim=16,
                                   mlp_dim=128, vocab_size=97, attention_impl=impl, compute_dtype="float32",
                                   remat=remat, remat_every=every)
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 97, (2, 128), dtype=np.int32))
    seg = jnp.asarray(np.sort(rng.integers(1, 4, (2, 128)), axis=1), jnp.int32)  # packed rows: 1-3 documents
    batch = dict(tokens=tokens, labels=shift_labels(tokens, seg), segment_ids=seg)
    plain_loss, plain = _loss_and_grads(base, mesh, batch, seed)
    kept_loss, kept = _loss_and_grads(dataclasses.replace(base, attn_keep=True), mesh, batch, seed)
    assert abs(float(kept_loss) - float(plain_loss)) <= 1e-5 * abs(float(plain_loss))
    for g, want in zip(jax.tree.leaves(kept), jax.tree.leaves(plain)):
        assert rel_err(np.asarray(g), np.asarray(want)) < 1e-4


@pytest.mark.parametrize("remat", [pytest.param("full", marks=pytest.mark.slow), "save_matmuls"])  # offload with --attn-keep: refused for mixed kinds
def test_a_hybrid_keeps_both_mixers_outputs_with_the_same_loss_and_gradients(remat, seed):
    """A hybrid (tiny-hybrid's delta-net and attention layers, fsdp 2 x sp 4, packed rows): with ``attn_keep`` the
    delta-net's output and its rule's block states are kept too (``keep_output``, ``BLOCK_STATES``): the same loss and
    gradients as plain remat (the XLA walk: the Pallas walk in interpret mode took 40 s of the default suite on two
    cores), and one Pallas walk fewer in the traced gradient (the rule's forward is not run again; traced only)."""
    mesh = make_mesh(fsdp=2, sp=4)
    base = ModelConfig.from_preset("tiny-hybrid", num_layers=2, hidden=64, vocab_size=97, mlp_dim=128,
                                   compute_dtype="float32", attention_impl="blockwise", remat=remat,
                                   layer_pattern=("linear", "global"), delta_impl="xla")
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 97, (2, 128), dtype=np.int32))
    seg = jnp.asarray(np.sort(rng.integers(1, 4, (2, 128)), axis=1), jnp.int32)
    batch = dict(tokens=tokens, labels=shift_labels(tokens, seg), segment_ids=seg)
    plain_loss, plain = _loss_and_grads(base, mesh, batch, seed)
    kept_cfg = dataclasses.replace(base, attn_keep=True)
    kept_loss, kept = _loss_and_grads(kept_cfg, mesh, batch, seed)
    assert abs(float(kept_loss) - float(plain_loss)) <= 1e-5 * abs(float(plain_loss))
    # The delta-net's gate gradients (A_log, dt_bias, wa) are sums over every token that nearly cancel: 2e-5 to 4e-2 of
    # the median gradient's largest element over 300 seeds, and float32's rounding, which differs where the forward is
    # kept instead of run again, reached 2.5e-3 of their own largest element (1e-4 failed 23 seeds of 200). So each
    # gradient is held to 1e-4 of its largest element or of a tenth of the median gradient's, whichever is larger: at
    # most 1.06e-5 over 450 seeds (300 save_matmuls, 150 full), every other gradient at most 1.1e-6 of its own. A gate
    # gradient 31% wrong (in the seed where it is smallest; 0.07% at its median size) would exceed it.
    floor = 0.1 * float(np.median([np.abs(np.asarray(w)).max() for w in jax.tree.leaves(plain)]))
    for g, want in zip(jax.tree.leaves(kept), jax.tree.leaves(plain)):
        g, want = np.asarray(g, np.float64), np.asarray(want, np.float64)
        assert np.abs(g - want).max() <= 1e-4 * max(np.abs(want).max(), floor)
    loops = {}
    for cfg in (dataclasses.replace(c, delta_impl="pallas") for c in (base, kept_cfg)):
        graphdef, state = nnx.split(Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0)))
        jaxpr = jax.make_jaxpr(jax.grad(lambda st: next_token_loss(nnx.merge(graphdef, st), batch).loss))(state)
        loops[cfg.attn_keep] = _count(jaxpr.jaxpr, "pallas_call")  # the Pallas walks (interpret mode here)
    assert loops == {False: 4, True: 3}, loops  # the forward, its re-run by remat (not with keep), the backward's two


def _count(jaxpr, name: str, where=lambda eqn: True) -> int:
    """How many equations of primitive ``name`` (for which ``where(eqn)`` holds) a jaxpr holds, inside loops, remat
    and custom rules included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name and bool(where(eqn))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    n += _count(inner, name, where)
    return n


@pytest.mark.parametrize("remat", ["full", "offload"])
def test_the_kept_path_runs_attention_forward_once(remat):
    """On CPU, in the traced training gradient: with ``attn_keep`` the program holds fewer loops (the blockwise
    kernel's forward is not re-run by remat) and names the kept output; a config that ignored the flag fails."""
    mesh = make_mesh(fsdp=2, sp=4)
    base = ModelConfig.from_preset("tiny", num_layers=2, hidden=64, num_heads=8, num_kv_heads=4, head_dim=16,
                                   mlp_dim=128, vocab_size=97, attention_impl="blockwise", compute_dtype="float32",
                                   remat=remat)
    tokens = jnp.zeros((2, 128), jnp.int32)
    seg = jnp.ones((2, 128), jnp.int32)
    batch = dict(tokens=tokens, labels=shift_labels(tokens, seg), segment_ids=seg)
    loops, named = {}, {}
    for keep in (False, True):
        cfg = dataclasses.replace(base, attn_keep=keep)
        graphdef, state = nnx.split(Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0)))
        jaxpr = jax.make_jaxpr(jax.grad(lambda st: next_token_loss(nnx.merge(graphdef, st), batch).loss))(state)
        loops[keep] = _count(jaxpr.jaxpr, "while")
        named[keep] = "attn_out" in str(jaxpr)
    assert loops[True] < loops[False], loops
    assert named == {False: False, True: True}


def test_attn_keep_needs_remat_and_the_whole_sublayer():
    with pytest.raises(ValueError, match=r"attn_keep \(--attn-keep\) has nothing to keep without remat"):
        ModelConfig(attn_keep=True)
    with pytest.raises(ValueError, match=r"attn_keep \(--attn-keep\) is for the attention sublayer whole"):
        ModelConfig(attn_keep=True, remat="full", attn_chunk=64)
    from ulysses_jax.train.devices import check_parallel

    with pytest.raises(ValueError, match=r"^--attn-keep keeps the attention output of Ulysses alone; with --mesh.ring 2"):
        check_parallel(ModelConfig.from_preset("tiny", attn_keep=True, remat="full", attention_impl="blockwise"),
                       make_mesh(ring=2, sp=4), seq_len=256, batch_size=1)


@pytest.mark.aot
@pytest.mark.slow  # two plans of an 8K hybrid step: 59 s on 2 cores
def test_the_compiled_hybrid_step_runs_the_delta_rule_forward_once_per_layer():
    """tiny-hybrid (3 delta-net layers of 4) at 8K on one compile-only H100, the Pallas walk: plain --remat full walks
    each block of 4,096 tokens forward twice (the forward, and again by remat), with --attn-keep once, as without remat;
    the backward's walks stay one each; device memory about the same (the output kept shares attention's slot)."""
    from ulysses_jax.model.config import ModelConfig as Model
    from ulysses_jax.plan import hlo, reruns
    from ulysses_jax.plan.planner import PlanConfig, plan

    walks, memory = {}, {}
    for keep in (False, True):
        cfg = PlanConfig(preset="tiny-hybrid", seq_len=8192, batch_size=1, devices=1, mesh=MeshConfig(fsdp=1, sp=1),
                         remat="full", attn_keep=keep, delta_impl="pallas", loss_chunk=4096, mlp_chunk=4096,
                         kernels=False)
        p = plan(cfg, detail=False)
        count = {}
        for i, times in hlo.executed(p.hlo_text, reruns.branch_shares(Model.from_preset("tiny-hybrid"))):
            for kernel in ("gated_delta_scan_fwd", "gated_delta_scan_bwd"):
                if i.opcode == "custom-call" and kernel in i.attrs:
                    count[kernel] = count.get(kernel, 0) + times
        walks[keep], memory[keep] = count, p.memory["total_bytes"]
    blocks = 3 * 2  # linear layers x blocks of 4,096 tokens
    assert walks[False] == {"gated_delta_scan_fwd": 2 * blocks, "gated_delta_scan_bwd": blocks}, walks
    assert walks[True] == {"gated_delta_scan_fwd": blocks, "gated_delta_scan_bwd": blocks}, walks
    assert memory[True] < 1.2 * memory[False], memory


@pytest.mark.aot
@pytest.mark.parametrize("every", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_the_compiled_step_runs_attention_forward_once_per_layer(every):
    """llama3.2-1b at 16K on 8 compile-only H100s, cuDNN packed: plain --remat full runs each layer's attention
    forward 2 times (3 with --remat-every 2); with --attn-keep once, its backward once per layer."""
    from ulysses_jax.plan import reruns
    from ulysses_jax.plan.planner import PlanConfig, plan

    calls = {}
    for keep in (False, True):
        cfg = PlanConfig(preset="llama3.2-1b", seq_len=16384, batch_size=1, mesh=MeshConfig(fsdp=1, sp=8),
                         remat="full", remat_every=every, attn_keep=keep, kernels=False)
        p = plan(cfg, detail=False)
        work = reruns.program_work(p.hlo_text)
        backward = p.hlo_text.count('custom_call_target="__cudnn$fmhaSoftmaxBackward"')
        calls[keep] = (work.attention_forward_calls, work.attention_kernel, backward)
    layers = 16
    assert calls[False][:2] == ((2 if every == 1 else 3) * layers, "cudnn")
    assert calls[True][:2] == (layers, "cudnn") and calls[True][2] >= 1
