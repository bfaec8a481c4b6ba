"""GPU-only checks (``make test-gpu`` on a machine with a GPU): cuDNN (packed rows too) and our compiled kernel at
long lengths, and a few training steps with ``attention="auto"``. Skipped everywhere else."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from np_reference import rel_err

from ulysses_jax import attention, make_mesh, ulysses_attention
from ulysses_jax.kernels.attention import gpu_capability, resolve_impl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
]
TOL_BF16 = 2e-2  # bf16 outputs/gradients against a float32-softmax reference (see np_reference.TOL)


def inputs(seed, s, h=4, hkv=2, d=128, b=1):
    ks = jax.random.split(jax.random.key(seed), 4)
    shapes = [(b, s, h, d), (b, s, hkv, d), (b, s, hkv, d), (b, s, h, d)]
    return [jax.random.normal(k, sh, jnp.bfloat16) for k, sh in zip(ks, shapes)]


def fwd_bwd(impl, causal):
    def f(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, causal=causal, impl=impl), q, k, v)
        return out, vjp(do)

    return jax.jit(f)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("s", [8192, 16384, 32768])
def test_cudnn_and_pallas_agree_with_reference(s, causal, seed):
    q, k, v, do = inputs(seed, s)
    # the XLA reference holds [B, H, S, S] float32 scores: up to 16K here; at 32K cuDNN is checked
    # against our kernel, which is itself checked against the reference up to 16K
    want = fwd_bwd("xla" if s <= 16384 else "pallas", causal)(q, k, v, do)
    for impl in ("cudnn", "pallas"):
        got = fwd_bwd(impl, causal)(q, k, v, do)
        for name, g, w in zip(["out", "dq", "dk", "dv"], jax.tree.leaves(got), jax.tree.leaves(want)):
            assert rel_err(np.asarray(g, np.float32), np.asarray(w, np.float32)) < TOL_BF16, (impl, name)


# Each output of our compiled kernels comes from one kernel: O from the forward, dQ from the dQ kernel, dK and dV
# from the dK/dV kernel (all three on wgmma since 2026-11-25); each is checked against the float32 reference.
KERNEL_OF = {"out": "flash_attention_fwd", "dq": "flash_attention_dq", "dk": "flash_attention_dkv",
             "dv": "flash_attention_dkv"}


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal,segments,hkv", [(True, False, 4), (False, False, 2), (True, True, 1)],
                         ids=["causal-mha", "full-gqa", "causal-seg-mqa"])
def test_each_kernel_matches_the_float32_reference(d, causal, segments, hkv, seed):
    """bf16 inputs, S=4096 (not a multiple of every tile: 4000), 4 query heads: each kernel's output against the
    float32 reference on the same bf16-rounded inputs."""
    from ulysses_jax.kernels.flash_attention import flash_attention, reference

    s = 4000
    q, k, v, do = inputs(seed, s, h=4, hkv=hkv, d=d)
    seg = jnp.repeat(jnp.arange(5), s // 5)[None] if segments else None

    def run(f, *xs):
        out, vjp = jax.vjp(f, *xs)
        return dict(zip(["out", "dq", "dk", "dv"], [out, *vjp(do.astype(out.dtype))]))

    got = jax.jit(lambda q, k, v: run(lambda *a: flash_attention(*a, causal=causal, segment_ids=seg), q, k, v))(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = jax.jit(lambda q, k, v: run(lambda *a: reference(*a, causal=causal, segment_ids=seg), q, k, v))(*f32)
    for name, g in got.items():
        err = rel_err(np.asarray(g, np.float32), np.asarray(want[name], np.float32))
        assert err < TOL_BF16, (KERNEL_OF[name], name, err)


def test_auto_picks_cudnn_with_and_without_segments():
    assert resolve_impl("auto", dtype=jnp.bfloat16, head_dim=128, has_segment_ids=False) == "cudnn"
    assert resolve_impl("auto", dtype=jnp.bfloat16, head_dim=128, has_segment_ids=True) == "cudnn"
    hopper = gpu_capability() >= (9, 0)  # head_dim 256: cuDNN on Hopper, our kernel before
    assert resolve_impl("auto", dtype=jnp.bfloat16, head_dim=256, has_segment_ids=True) == (
        "cudnn" if hopper else "pallas")


def packed_segments(rng, rows, s, docs, pad, ones=0):
    """Segment ids as the packer writes them: per row ``docs + row`` documents of random lengths (the first ``ones``
    of length 1), then ``pad`` padding tokens (id 0)."""
    out = np.zeros((rows, s), np.int32)
    for r in range(rows):
        n = docs + r
        cuts = np.sort(rng.choice(np.arange(ones + 1, s - pad), size=n - 1 - ones, replace=False))
        bounds = np.concatenate([np.arange(ones + 1), cuts, [s - pad]])
        for j in range(n):
            out[r, bounds[j]:bounds[j + 1]] = j + 1
    return out


@pytest.mark.parametrize("rows,h,hkv,d,docs,pad,ones,causal,window", [
    (3, 8, 8, 128, 12, 300, 0, True, None),
    (2, 8, 2, 128, 10, 0, 3, True, None),
    (2, 4, 1, 128, 1, 0, 0, True, None),
    (2, 8, 2, 128, 6, 100, 0, True, 512),
    (2, 8, 4, 64, 5, 64, 0, True, None),
    (2, 8, 2, 128, 5, 64, 0, False, None),
    (2, 4, 1, 256, 5, 64, 0, True, None),  # Qwen3.5's full-attention head_dim (cuDNN takes 256 on Hopper)
], ids=["many-docs-pad-mha", "len1-docs-gqa", "one-doc-mqa", "window-gqa-pad", "hd64-pad", "full-gqa-pad",
        "hd256-pad"])
def test_packed_cudnn_matches_the_float32_reference(rows, h, hkv, d, docs, pad, ones, causal, window, seed):
    """Packed rows on cuDNN (segment ids turned into ragged offsets, kernels/cudnn_packed.py) against the float32
    reference: several rows with different document counts (cudnn-frontend #737 mis-addressed ragged offsets across
    rows), documents of length 1, padding, GQA/MQA, a window. Output and dQ at real tokens; dK and dV everywhere
    (zero at padding: cuDNN left them unwritten with GQA until the inputs were masked)."""
    rng = np.random.default_rng(seed)
    s = 4096
    q, k, v, do = inputs(seed, s, h=h, hkv=hkv, d=d, b=rows)
    seg_np = packed_segments(rng, rows, s, docs, pad, ones)
    seg, real = jnp.asarray(seg_np), (seg_np != 0)[..., None, None]
    do = jnp.where(real, do, 0)

    def run(impl, *xs):
        f = lambda q, k, v: attention(q, k, v, causal=causal, segment_ids=seg, impl=impl, window=window)  # noqa: E731
        out, vjp = jax.vjp(f, *xs)
        return [out, *vjp(do.astype(out.dtype))]

    got = jax.jit(lambda *x: run("cudnn", *x))(q, k, v)
    want = jax.jit(lambda *x: run("xla", *x))(*(x.astype(jnp.float32) for x in (q, k, v)))
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if name in ("out", "dq"):
            g, w = g * real, w * real
        assert rel_err(g, w) < TOL_BF16, (name, rel_err(g, w))


@pytest.mark.parametrize("d,hkv", [(64, 8), (128, 2)], ids=["hd64-gqa", "hd128-gqa"])
def test_one_document_rows_on_cudnn_match_the_float32_reference(d, hkv, seed):
    """``max_documents=1`` (``--attn-max-documents 1``): cuDNN with its causal mask alone (kernels/cudnn_packed.py
    ``_ragged``) on rows of one document then padding of different lengths, against the float32 reference with the
    segment ids: output and dQ at real tokens, dK and dV everywhere (zero at padding)."""
    rng = np.random.default_rng(seed)
    s, rows, h = 4096, 3, 32
    q, k, v, do = inputs(seed, s, h=h, hkv=hkv, d=d, b=rows)
    lengths = np.array([s, *rng.integers(1, s, rows - 1)])
    seg_np = (np.arange(s)[None] < lengths[:, None]).astype(np.int32)
    seg, real = jnp.asarray(seg_np), (seg_np != 0)[..., None, None]
    do = jnp.where(real, do, 0)

    def run(impl, *xs):
        f = lambda q, k, v: attention(q, k, v, causal=True, segment_ids=seg, impl=impl,  # noqa: E731
                                      max_documents=1 if impl == "cudnn" else None)
        out, vjp = jax.vjp(f, *xs)
        return [out, *vjp(do.astype(out.dtype))]

    got = jax.jit(lambda *x: run("cudnn", *x))(q, k, v)
    want = jax.jit(lambda *x: run("xla", *x))(*(x.astype(jnp.float32) for x in (q, k, v)))
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if name in ("out", "dq"):
            g, w = g * real, w * real
        assert rel_err(g, w) < TOL_BF16, (name, rel_err(g, w))


def test_ulysses_on_one_gpu_matches_local(seed):
    mesh = make_mesh(sp=1, devices=jax.devices()[:1])
    q, k, v, _ = inputs(seed, 4096)
    seg = jnp.repeat(jnp.arange(4), 1024)[None]
    got = ulysses_attention(q, k, v, mesh=mesh, segment_ids=seg, impl="auto")
    want = attention(q, k, v, segment_ids=seg, impl="xla")
    assert rel_err(np.asarray(got, np.float32), np.asarray(want, np.float32)) < TOL_BF16


def test_a_few_training_steps(tmp_path):
    from ulysses_jax.train.config import TrainConfig
    from ulysses_jax.train.devices import MeshConfig
    from ulysses_jax.train.trainer import train

    cfg = TrainConfig(preset="tiny", seq_len=8192, batch_size=jax.device_count(), steps=5, checkpoint_every=5,
                      progress=False, mesh=MeshConfig(fsdp=-1, sp=1), run_dir=str(tmp_path / "run"))
    summary = train(cfg)
    assert summary["steps"] == 5 and np.isfinite(summary["last_loss"]) and summary["last_loss"] < summary["first_loss"]


def test_train_without_memory_flags_takes_the_fastest_set_that_fits(tmp_path):
    """`train` on an H100 or H200 given no memory flag (`--memory auto`, the default): the search compiles the step
    with each set of memory tools for this GPU's compile-only target, the run trains with the fastest that fits, and
    the start lines say so; its run.json holds the picked tools (the CPU tests run the choice on stand-in plans)."""
    import json
    import os
    import subprocess
    import sys

    from ulysses_jax.plan.train_memory import target_for

    if target_for(jax.devices()[0].device_kind) is None:
        pytest.skip(f"plan compiles for H100 and H200 only, not {jax.devices()[0].device_kind}")
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, "-m", "ulysses_jax", "train", "--preset", "tiny", "--seq-len", "8192",
                        "--steps", "2", "--no-progress", "--mesh.sp", "1", "--run-dir", str(run)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("memory: ")]
    assert lines[0].startswith("memory: no memory flag given (--memory auto): compiling"), lines
    picked = next(ln for ln in lines[1:] if "(--memory auto, no memory flag given" in ln)
    flags = picked[len("memory: "):picked.index(" (--memory auto")].split()
    config = json.loads((run / "run.json").read_text())["config"]
    for flag in ("--remat", "--loss-chunk", "--mlp-chunk"):  # the run trained with the tools the line names
        if flag in flags:
            got = config[flag[2:].replace("-", "_")]
            assert str(got) == flags[flags.index(flag) + 1], (flag, got, picked)


def test_a_hybrid_trains_with_either_delta_walk(tmp_path):
    """tiny-hybrid (3 delta-net layers, 1 attention layer) for 5 steps of 8K with the XLA walk and the Pallas walk
    (Triton here): both learn, and their losses agree step by step (float32 products; the Pallas walk's are tf32x3)."""
    from ulysses_jax.train.config import TrainConfig
    from ulysses_jax.train.devices import MeshConfig
    from ulysses_jax.train.trainer import train

    losses = {}
    for impl in ("xla", "pallas"):
        cfg = TrainConfig(preset="tiny-hybrid", seq_len=8192, batch_size=jax.device_count(), steps=5,
                          checkpoint_every=5, progress=False, mesh=MeshConfig(fsdp=-1, sp=1), delta_impl=impl,
                          run_dir=str(tmp_path / impl))
        summary = train(cfg)
        assert summary["steps"] == 5 and summary["last_loss"] < summary["first_loss"]
        losses[impl] = (summary["first_loss"], summary["last_loss"])
    np.testing.assert_allclose(losses["pallas"], losses["xla"], rtol=2e-3)


def test_lora_with_fp8_trains_and_its_step_holds_what_bf16_holds(tmp_path):
    """LoRA + --fp8 on the GPU: the base rests in float8 (model/fp8_base.py), the step's float8 GEMMs run on it and the
    tiny preset learns in 5 steps of 8K; llama3.2-1b (4 layers, LoRA r16) at 8K: the compiled step's temporaries with
    --fp8 no more than bf16's (on a compile-only H100: equal; before, XLA added a transposed bf16 copy of every stacked
    projection weight)."""
    import dataclasses

    from ulysses_jax.model.config import ModelConfig
    from ulysses_jax.model.lora_config import LoraConfig
    from ulysses_jax.train.config import TrainConfig
    from ulysses_jax.train.devices import MeshConfig
    from ulysses_jax.train.program import step_program
    from ulysses_jax.train.step import OptimConfig, abstract_state, make_optimizer
    from ulysses_jax.train.trainer import train

    cfg = TrainConfig(preset="tiny", seq_len=8192, batch_size=jax.device_count(), steps=5, checkpoint_every=5,
                      progress=False, mesh=MeshConfig(fsdp=-1, sp=1), lora_rank=4, fp8=True,
                      run_dir=str(tmp_path / "run"))
    summary = train(cfg)
    assert summary["steps"] == 5 and np.isfinite(summary["last_loss"]) and summary["last_loss"] < summary["first_loss"]

    mesh = make_mesh(devices=jax.devices()[:1])
    temp = {}
    for fp8_on in (False, True):
        model = dataclasses.replace(ModelConfig.from_preset("llama3.2-1b"), num_layers=4, param_dtype="bfloat16",
                                    remat="full", fp8=fp8_on, lora=LoraConfig(rank=16, alpha=32.0))
        optim = OptimConfig()
        tx = make_optimizer(optim, 10)
        graphdef, state = abstract_state(model, mesh, tx)
        step, batch = step_program(graphdef, state, tx, optim, steps=10, mesh=mesh, batch_size=1, seq_len=8192)
        temp[fp8_on] = step.trace(state, batch).lower().compile().memory_analysis().temp_size_in_bytes
    print(f"\nLoRA step temporaries: bf16 {temp[False] / 2**20:.0f} MiB, --fp8 {temp[True] / 2**20:.0f} MiB")
    assert temp[True] <= 1.02 * temp[False], temp


def test_offload_params_puts_layers_and_their_gradients_in_host_memory():
    """--offload-params on a real GPU (the compile-only H100 target has no memory kinds, so plan cannot show it):
    the stacked layers' parameters are a host argument, and the device temporaries shrink by at least their size
    (one layer's gradient at a time instead of all of them)."""
    import dataclasses

    from ulysses_jax.model.config import ModelConfig
    from ulysses_jax.train.step import (
        BATCH_KEYS,
        OptimConfig,
        abstract_state,
        batch_sharding,
        make_optimizer,
        make_schedule,
        make_train_step,
    )

    mesh = make_mesh(devices=jax.devices()[:1])
    found = {}
    for offload_params in (False, True):
        cfg = dataclasses.replace(ModelConfig.from_preset("llama3.2-1b"), num_layers=4, param_dtype="bfloat16",
                                  remat="full", offload_params=offload_params)
        optim = OptimConfig(master_weights=True, offload=True)
        tx = make_optimizer(optim, 10)
        graphdef, state = abstract_state(cfg, mesh, tx)
        step = make_train_step(graphdef, tx, make_schedule(optim, 10), mesh, jax.tree.map(lambda x: x.sharding, state))
        batch = {k: jax.ShapeDtypeStruct((1, 4096), jnp.int32, sharding=batch_sharding(mesh)) for k in BATCH_KEYS}
        found[offload_params] = step.trace(state, batch).lower().compile().memory_analysis()
        layers = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state["params"]["blocks"]))
    plain, streamed = found[False], found[True]
    print(f"\nstacked bf16 layers {layers / 2**20:.0f} MiB; device argument "
          f"{plain.argument_size_in_bytes / 2**20:.0f} -> "
          f"{streamed.argument_size_in_bytes / 2**20:.0f} MiB, temp {plain.temp_size_in_bytes / 2**20:.0f} -> "
          f"{streamed.temp_size_in_bytes / 2**20:.0f} MiB")
    assert streamed.host_argument_size_in_bytes >= plain.host_argument_size_in_bytes + layers
    assert streamed.argument_size_in_bytes <= plain.argument_size_in_bytes - layers
    assert streamed.temp_size_in_bytes <= plain.temp_size_in_bytes - 0.75 * layers


def test_tiled_attention_in_head_groups_matches_the_plain_sublayer(seed):
    """--attn-chunk with --attn-head-chunk 1 and --attn-recompute on a GPU (Pallas compiled through Triton, bf16,
    layer inputs in pinned host memory): the loss and gradients of the plain attention sublayer, within bf16
    rounding. The CPU suite checks the same in float32 (tests/test_model.py)."""
    import dataclasses

    from flax import nnx

    from ulysses_jax import ModelConfig, Transformer, next_token_loss, shift_labels

    mesh = make_mesh(devices=jax.devices()[:1])
    base = ModelConfig.from_preset("llama3.2-1b", num_layers=2, hidden=512, num_heads=8, num_kv_heads=2, head_dim=64,
                                   mlp_dim=1024, vocab_size=256, attention_impl="pallas", remat="offload",
                                   loss_chunk=1024, mlp_chunk=1024)
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 256, (1, 8192), dtype=np.int32))
    seg = jnp.asarray(np.repeat(np.arange(4), 2048)[None], jnp.int32)
    batch = dict(tokens=tokens, labels=shift_labels(tokens, seg), segment_ids=seg)
    results = []
    tiled = dataclasses.replace(base, attn_chunk=1024, attn_head_chunk=1, attn_recompute=True)
    # and with the layer inputs inside a remat group offloaded too (--remat-every 2 --remat-nested)
    for cfg in (base, tiled, dataclasses.replace(tiled, remat_every=2, remat_nested=True)):
        graphdef, state = nnx.split(Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(seed)))
        loss = jax.jit(jax.value_and_grad(lambda st: next_token_loss(nnx.merge(graphdef, st), batch).loss))
        results.append(loss(state))
    (plain_loss, plain_grads), *others = results
    for tiled_loss, tiled_grads in others:
        assert abs(float(tiled_loss) - float(plain_loss)) <= 1e-2 * abs(float(plain_loss))
        # whole-model bf16 gradients, two summation orders (not one attention call: TOL_BF16); the same comparison
        # on CPU with the blockwise kernel gives 1.3e-2 at most
        for g, want in zip(jax.tree.leaves(tiled_grads), jax.tree.leaves(plain_grads)):
            assert rel_err(np.asarray(g, np.float32), np.asarray(want, np.float32)) < 5e-2


@pytest.mark.parametrize("packed,window,m", [(True, None, None), (True, 512, 8), (False, None, None), (True, None, 1)],
                         ids=["packed", "packed-window", "unpacked", "one-document"])
def test_kept_cudnn_matches_the_float32_reference(packed, window, m, seed):
    """--attn-keep on cuDNN (parallel/kept.py): its forward and backward primitives called apart, from the kept output
    and statistics; outputs and gradients against the float32 reference (GQA 8/2, two rows, padding)."""
    from ulysses_jax.parallel.kept import kept_attention

    rng = np.random.default_rng(seed)
    s, rows = 4096, 2
    q, k, v, do = inputs(seed, s, h=8, hkv=2, d=128, b=rows)
    if not packed:
        seg_np = np.ones((rows, s), np.int32)
    elif m == 1:
        seg_np = np.zeros((rows, s), np.int32)
        seg_np[0, :3000], seg_np[1, :] = 1, 1  # one document from the row's start, then padding
    else:
        seg_np = packed_segments(rng, rows, s, 6, 200)
    seg = jnp.asarray(seg_np) if packed else None
    real = (seg_np != 0)[..., None, None]
    do = jnp.where(real, do, 0)

    def run(f, *xs):
        out, vjp = jax.vjp(f, *xs)
        return [out, *vjp(do.astype(out.dtype))]

    got = jax.jit(lambda *x: run(lambda q, k, v: kept_attention(
        q, k, v, seg, causal=True, scale=128 ** -0.5, impl="cudnn", platform="gpu", window=window, max_documents=m),
        *x))(q, k, v)
    want = jax.jit(lambda *x: run(lambda q, k, v: attention(q, k, v, causal=True, segment_ids=seg, impl="xla",
                                                              window=window), *x))(*(x.astype(jnp.float32)
                                                                                     for x in (q, k, v)))
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if name in ("out", "dq"):
            g, w = g * real, w * real
        assert rel_err(g, w) < TOL_BF16, (name, rel_err(g, w))


@pytest.mark.parametrize("precision,tol", [("highest", 1e-3), ("bf16", 3e-2)])
def test_pallas_delta_walk_matches_the_xla_walk(precision, tol, seed):
    """The gated delta rule's Pallas walk over chunks (Triton: tf32x3 products at ``highest``, bf16 operands at
    ``bf16``) against the XLA ``lax.scan`` walk on the GPU, Qwen3.5's heads (dk = dv = 128), 16K tokens in three
    documents, forward and the gradients of q, k, v, g, beta (bf16 inputs, rel_err of each)."""
    from ulysses_jax.kernels.gated_delta import gated_delta_rule, gates

    b, s, hk, hv, d = 1, 16384, 2, 4, 128
    ks = jax.random.split(jax.random.key(seed), 6)
    q, k = (jax.random.normal(ks[i], (b, s, hk, d), jnp.bfloat16) for i in (0, 1))
    v, do = (jax.random.normal(ks[i], (b, s, hv, d), jnp.bfloat16) for i in (2, 3))
    g, beta = gates(jax.random.normal(ks[4], (b, s, hv)), jax.random.normal(ks[5], (b, s, hv)),
                    jnp.log(jnp.linspace(1.0, 16.0, hv)), jnp.ones(hv))
    seg = jnp.concatenate([jnp.zeros((b, 5000), jnp.int32), jnp.ones((b, 7000), jnp.int32),
                           jnp.full((b, s - 12000), 2, jnp.int32)], axis=1)

    def run(impl):
        def f(*x):
            return gated_delta_rule(*x, segment_ids=seg, precision=precision, impl=impl)

        o, vjp = jax.vjp(f, q, k, v, g, beta)
        return o, vjp(do)

    (o, d_pallas), (o_ref, d_ref) = jax.jit(lambda: run("pallas"))(), jax.jit(lambda: run("xla"))()
    assert rel_err(o, o_ref) < tol
    for x, y in zip(d_pallas, d_ref):
        assert rel_err(x, y) < tol
