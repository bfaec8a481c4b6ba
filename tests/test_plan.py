"""The H100 program compiled without a GPU: `ulysses-jax plan`, the exchange and the train step on compile-only
H100s (``ulysses_jax.plan.targets``). Marked aot: they need the CUDA plugin (the aot extra; `make test` installs it)."""

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from ulysses_jax import ModelConfig, exchange_bytes, make_mesh, plan_heads, ulysses_attention
from ulysses_jax.kernels.attention import device_platform, resolve_impl
from ulysses_jax.model.transformer import remat_policy
from ulysses_jax.plan import hlo, reruns
from ulysses_jax.plan.kernel_report import dump_options, kernels
from ulysses_jax.plan.planner import PlanConfig, plan
from ulysses_jax.plan.targets import TARGETS, target_devices
from ulysses_jax.train.devices import MeshConfig
from ulysses_jax.train.step import OptimConfig

pytestmark = pytest.mark.aot
ROOT = pathlib.Path(__file__).parents[1]
FLASH = {"flash_attention_fwd", "flash_attention_dkv", "flash_attention_dq"}


def h100_mesh(**axes):
    return make_mesh(devices=target_devices("h100", devices=8), **axes)


def test_targets_are_gpus_and_decisions_follow_the_mesh():
    mesh = h100_mesh(fsdp=2, sp=4)
    assert device_platform(mesh) == "gpu" and mesh.devices.flat[0].device_kind == TARGETS["h100"].device_kind
    assert jax.default_backend() == "cpu"  # the machine we sit on
    assert resolve_impl("auto", dtype=jnp.bfloat16, head_dim=128, has_segment_ids=False, platform="gpu") == "cudnn"
    assert resolve_impl("auto", dtype=jnp.bfloat16, head_dim=128, has_segment_ids=True, platform="gpu") == "cudnn"
    assert not mesh.devices.flat[0].addressable_memories()  # compile-only GPUs list no memory kinds...
    assert remat_policy("offload", mesh) is not None  # ...yet the offload compiles for them (tiny plan below)


def test_multi_host_topology():
    devs = target_devices("h200", devices=16, hosts=2)
    assert len(devs) == 16 and sorted({d.process_index for d in devs}) == [0, 1]
    with pytest.raises(ValueError, match="multiple of --hosts"):
        target_devices("h100", devices=12, hosts=5)
    with pytest.raises(ValueError, match="unknown target 'a100'"):
        target_devices("a100", devices=8)


def test_ulysses_pallas_compiles_for_8_h100s_with_formula_all_to_alls(tmp_path):
    """Forward + backward of the exchange around our kernel: Triton kernels, 2 all-to-alls per call each way."""
    mesh = h100_mesh(fsdp=2, sp=4)
    b, s, h, hkv, d = 2, 4096, 8, 2, 64
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"), "sp"))
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16, sharding=sh)
    kv = jax.ShapeDtypeStruct((b, s, hkv, d), jnp.bfloat16, sharding=sh)
    w = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16, sharding=sh)

    def loss(q, k, v, w):  # not a plain sum, so the output's all-to-all keeps its transpose
        o = ulysses_attention(q, k, v, mesh=mesh, impl="pallas")
        return jnp.sum(o.astype(jnp.float32) * w.astype(jnp.float32))

    def fwd(q, k, v):
        return ulysses_attention(q, k, v, mesh=mesh, impl="pallas")

    layout = plan_heads(h, hkv, 4)
    want = exchange_bytes(layout, batch=b // 2, seq_len=s, head_dim=d, itemsize=2)
    both = jax.value_and_grad(loss, argnums=(0, 1, 2))
    for i, (fn, args, calls) in enumerate(((fwd, (q, kv, kv), 1), (both, (q, kv, kv, w), 2))):
        dump = tmp_path / str(i)
        compiled = jax.jit(fn).trace(*args).lower().compile(compiler_options=dump_options(dump))
        a2a = hlo.collectives(compiled.as_text())["all-to-all"]
        assert a2a.count == 2 * calls
        assert a2a.bytes == calls * (want["qkv"] + want["out"])
        names = {k.name for k in kernels(dump, prefix="flash_attention", run_ptxas=False)}
        assert names == ({"flash_attention_fwd"} if calls == 1 else FLASH)


def _check_consistent(p, state_floor: int):
    m = p.memory
    assert m["total_bytes"] == m["argument_bytes"] + m["output_bytes"] + m["temp_bytes"] - m["alias_bytes"]
    assert m["argument_bytes"] >= state_floor
    assert m["alias_bytes"] >= p.breakdown["parameters"] + p.breakdown["optimizer"]  # the state is donated
    assert m["budget_bytes"] == int(0.9 * TARGETS["h100"].memory_bytes)


def test_tiny_train_step_plan(tmp_path):
    cfg = PlanConfig(preset="tiny", seq_len=8192, batch_size=2, mesh=MeshConfig(fsdp=2, sp=4), attention="pallas",
                     json=str(tmp_path / "p.json"))
    p = plan(cfg)
    _check_consistent(p, p.breakdown["parameters"] + p.breakdown["optimizer"])
    assert p.fits and p.num_devices == 8 and p.mesh == {"data": 1, "fsdp": 2, "ring": 1, "sp": 4}
    model = ModelConfig.from_preset("tiny")
    # per layer: Q/K/V and O forward, their transposes backward; bytes from the exchange formula (float32 model)
    ex = exchange_bytes(plan_heads(model.num_heads, model.num_kv_heads, 4), batch=1, seq_len=8192,
                        head_dim=model.head_dim, itemsize=4)
    a2a = p.collectives["all-to-all"]
    assert a2a.count == 4 * model.num_layers
    assert a2a.bytes == 2 * model.num_layers * (ex["qkv"] + ex["out"])
    assert {"all-gather", "reduce-scatter"} <= set(p.collectives)  # FSDP: gather weights, scatter gradients
    assert {k.name for k in p.kernels} == FLASH
    assert all(k.registers and k.shared_memory_bytes <= 232_448 for k in p.kernels)


def test_llama8b_full_depth_at_32k_on_8_h100s():
    cfg = PlanConfig(preset="llama3.1-8b", seq_len=32768, batch_size=1, mesh=MeshConfig(fsdp=1, sp=8),
                     attention="pallas", remat="full", loss_chunk=4096, mlp_chunk=4096, kernels=False)
    p = plan(cfg)
    params_f32 = 8_030_261_248 * 4  # Llama-3.1-8B parameters, float32 at rest, split over 8 devices
    assert p.breakdown["parameters"] == params_f32 // 8
    assert p.breakdown["optimizer"] >= 2 * params_f32 // 8  # AdamW's two moments
    _check_consistent(p, p.breakdown["parameters"] + p.breakdown["optimizer"])
    assert p.fits
    assert p.collectives["all-to-all"].count == 6 * 32  # remat=full re-runs the forward exchange in the backward
    assert p.collectives["all-to-all"].inter_host_bytes == 0  # sp=8 within the host


A2A_HLO = """HloModule m

ENTRY %main (p: f32[8,16]) -> f32[8,16] {
  %p = f32[8,16]{1,0} parameter(0)
  ROOT %a2a = f32[8,16]{1,0} all-to-all(%p), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
}
"""


@pytest.mark.parametrize("per_host, network", [(4, 0), (2, 256), (1, 384), (None, 0)])
def test_all_to_all_bytes_split_by_destination_host(per_host, network):
    """A 512-byte all-to-all in groups of 4: each member sends a quarter of its buffer to each; with 2 devices per
    host half of it leaves the host, with 1 three quarters (the own quarter never moves)."""
    c = hlo.collectives(A2A_HLO, devices_per_host=per_host, num_devices=8)["all-to-all"]
    assert (c.bytes, c.inter_host_bytes, c.intra_host_bytes) == (512, network, 512 - network)


RAGGED_HLO = """HloModule m

ENTRY %main (p: f32[8,16], o: f32[8,16], a: s32[4], b: s32[4], c: s32[4], d: s32[4]) -> f32[8,16] {
  %p = f32[8,16]{1,0} parameter(0)
  %o = f32[8,16]{1,0} parameter(1)
  %a = s32[4]{0} parameter(2)
  %b = s32[4]{0} parameter(3)
  %c = s32[4]{0} parameter(4)
  %d = s32[4]{0} parameter(5)
  ROOT %r = f32[8,16]{1,0} ragged-all-to-all(%p, %o, %a, %b, %c, %d), replica_groups={{0,1,2,3}}
}
"""


def test_ragged_all_to_all_counts_the_data_not_its_output_buffer():
    """A ragged all-to-all takes (data, output buffer, offsets, sizes): 512 bytes move, not 1,024 and the offsets."""
    assert hlo.collectives(RAGGED_HLO, devices_per_host=4, num_devices=4)["ragged-all-to-all"].bytes == 512


SWITCH_HLO = """HloModule m

%attn (a: f32[8,16]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0)
  ROOT %g = f32[8,16]{1,0} all-to-all(%a), replica_groups={{0,1,2,3}}, dimensions={0}
}

%linear (b: f32[8,16]) -> f32[8,16] {
  %b = f32[8,16]{1,0} parameter(0)
  %x = f32[8,16]{1,0} all-to-all(%b), replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %y = f32[8,16]{1,0} all-to-all(%x), replica_groups={{0,1,2,3}}, dimensions={0}
}

%body (t: (s32[], f32[8,16], s32[32])) -> (s32[], f32[8,16], s32[32]) {
  %t = (s32[], f32[8,16]{1,0}, s32[32]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %h = f32[8,16]{1,0} get-tuple-element(%t), index=1
  %kinds = s32[32]{0} get-tuple-element(%t), index=2
  %k = s32[1]{0} dynamic-slice(%kinds, %i), dynamic_slice_sizes={1}
  %kind = s32[] reshape(%k)
  %out = f32[8,16]{1,0} conditional(%kind, %h, %h), branch_computations={%attn, %linear}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %r = (s32[], f32[8,16]{1,0}, s32[32]{0}) tuple(%next, %out, %kinds)
}

%cond (t: (s32[], f32[8,16], s32[32])) -> pred[] {
  %t = (s32[], f32[8,16]{1,0}, s32[32]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(32)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (p: f32[8,16], kinds: s32[32]) -> f32[8,16] {
  %p = f32[8,16]{1,0} parameter(0)
  %kinds = s32[32]{0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}, s32[32]{0}) tuple(%zero, %p, %kinds)
  %w = (s32[], f32[8,16]{1,0}, s32[32]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"32"}}
  ROOT %res = f32[8,16]{1,0} get-tuple-element(%w), index=1
}
"""


def test_each_branch_of_a_layer_switch_counts_for_its_layers():
    """A layer scan of 32 trips whose switch runs attention (one all-to-all) in 8 layers and the delta-net (two) in 24:
    56 all-to-alls per step with the kinds' shares; 48 with no shares (each branch half the time). (Once only the
    first branch of a conditional was counted: 32 here, and a hybrid's delta-net exchanges went missing.)"""
    shares = {2: (8 / 32, 24 / 32)}
    assert hlo.collectives(SWITCH_HLO, branch_shares=shares)["all-to-all"].count == 8 + 2 * 24
    assert hlo.collectives(SWITCH_HLO)["all-to-all"].count == 16 + 2 * 16
    model = ModelConfig.from_preset("qwen3.5-9b")
    assert reruns.branch_shares(model) == {2: (8 / 32, 24 / 32)}


def _cli(*args, env=None):
    env = {k: v for k, v in (env or os.environ).items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "-m", "ulysses_jax", "plan", *args], capture_output=True, text=True,
                          env=env, timeout=600, cwd=ROOT)


def test_cli_plan_writes_json(tmp_path):
    out = tmp_path / "plan.json"
    r = _cli("--preset", "tiny", "--seq-len", "4096", "--batch-size", "2", "--mesh.fsdp", "2", "--mesh.sp", "4",
             "--attention", "pallas", "--no-kernels", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "verdict: FITS" in r.stdout and "all-to-all" in r.stdout
    j = json.loads(out.read_text())
    assert {"device_kind", "num_devices", "seq_len", "per_device", "fits", "collectives", "flops_per_step"} <= set(j)
    assert {"argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "host_bytes", "total_bytes",
            "budget_bytes"} <= set(j["per_device"])
    assert j["device_kind"] == "NVIDIA H100 80GB HBM3" and j["num_devices"] == 8 and j["fits"] is True
    assert j["collectives"]["all-to-all"]["count"] == 16 and j["collectives"]["all-to-all"]["bytes"] > 0


@pytest.mark.parametrize("args, message", [
    (["--target", "a100"], "unknown target 'a100'; choose one of h100, h200"),
    (["--devices", "6", "--mesh.sp", "4"], "--devices 6 does not fit the mesh flags"),
    (["--seq-len", "4098", "--mesh.sp", "4", "--mesh.fsdp", "2"], "--seq-len (4098) must be a positive multiple of"),
    (["--devices", "16", "--hosts", "3"], "--devices (16) must be a multiple of --hosts (3)"),
    # modelled as one all-NVLink host before (no collective over the network; found by a review)
    (["--devices", "16"], "--devices (16) over --hosts (1) puts 16 GPUs in a host, but an h100 host holds 8; pass "
                          "--hosts 2"),
    (["--budget-fraction", "1.5"], "--budget-fraction (1.5) must be in (0, 1]"),
    (["--budget-fraction", "0.97"], "--budget-fraction (0.97) must be at most --memory-fraction (0.95)"),
    (["--memory-fraction", "1.2"], "--memory-fraction (1.2) must be in (0, 1)"),
    (["--host-memory-gib", "-1"], "--host-memory-gib (-1.0) must be >= 0"),
])
def test_cli_plan_bad_input(args, message, capsys):
    """Each refusal in the process (``cli.main``, as tests/test_cli.py's train refusals): exit 2, one line naming the
    value, no traceback (a subprocess each cost 4-5 s a case, 39 s for the nine; the real entry point's refusal is the
    next test)."""
    from ulysses_jax import cli

    assert cli.main(["plan", "--preset", "tiny", "--no-kernels", *args]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], captured.err[-2000:]
    assert "Traceback" not in captured.err and not captured.out, captured.out[-1000:]


def test_cli_plan_bad_input_through_the_entry_point():
    """A refusal through ``python -m ulysses_jax``, the real entry point: exit 2, one line, no traceback."""
    r = _cli("--preset", "tiny", "--no-kernels", "--target", "a100")
    assert r.returncode == 2, r.stdout[-1000:] + r.stderr[-1000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "unknown target 'a100'; choose one of h100, h200" in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_missing_plugin_names_the_extra(monkeypatch):
    import ulysses_jax.plan.targets as targets

    monkeypatch.setattr(targets, "cuda_plugin_installed", lambda: False)
    with pytest.raises(ValueError, match=r"pip install 'ulysses-jax\[aot\]'"):
        targets.target_devices("h100", devices=8)


FLOAT8_GEMM = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from ulysses_jax.plan.targets import target_devices
s = NamedSharding(Mesh(np.array(target_devices("{target}", devices=1)), ("x",)), P())
f8, f32 = jnp.float8_e4m3fn, jnp.float32
args = [jax.ShapeDtypeStruct(shape, t, sharding=s) for shape, t in (((512, 256), f8), ((256, 384), f8), ((), f32))]
f = lambda x, w, sc: (jnp.dot(x, w, preferred_element_type=f32) * sc).astype(jnp.bfloat16)
print(jax.jit(f).lower(*args).compile().as_text())
"""


@pytest.mark.parametrize("target", ["h100", "h200"])
def test_targets_carry_the_cuda_runtime_so_float8_dots_can_be_cublaslt_gemms(target):
    """Without Triton's GEMMs, XLA makes a float8 dot a cuBLASLt float8 GEMM only for a CUDA runtime >= 12, which a
    compile-only target knows only from its ``runtime_version``: without it the operands were upcast to f16. The
    estimate's FLOP count and plan's float8 note read such a GEMM as a dot (before: no FLOPs at all, so the estimate
    of a program compiled so was 5x too fast)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
    r = subprocess.run([sys.executable, "-c", FLOAT8_GEMM.format(target=target)], capture_output=True, text=True,
                       timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'custom_call_target="__cublas$lt$matmul$f8"' in r.stdout, re.findall(r"custom_call_target=\S+", r.stdout)
    flops = 2 * 512 * 384 * 256
    assert reruns.program_work(r.stdout).dot_flops == flops
    assert hlo.float8_dots(r.stdout) == {"f8e4m3fn x f8e4m3fn": {"dots": 1, "flops": flops}}


def test_make_test_gpu_fails_without_a_gpu():
    r = subprocess.run(["make", "-o", ".venv/.installed", "test-gpu", f"PY={sys.executable}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "JAX sees no GPU" in r.stderr


def test_remat_full_keeps_one_copy_of_the_saved_layer_inputs(tmp_path):
    """remat=full saves each layer's input, stacked [L, B, S/sp, D]; the backward must read that stack as it is,
    not a transposed [D, L, B, S/sp] copy (27 GiB for Llama-3.1-8B at 884K tokens on 8 H100s)."""
    from ulysses_jax.plan.planner import largest_buffers
    from ulysses_jax.train.program import optimizer_of, step_program
    from ulysses_jax.train.step import OptimConfig, abstract_state

    cfg = ModelConfig.from_preset("tiny", remat="full", attention_impl="pallas", loss_chunk=4096, mlp_chunk=4096)
    mesh = h100_mesh(sp=8)
    tx = optimizer_of(OptimConfig(), 10)
    graphdef, state = abstract_state(cfg, mesh, tx)
    seq = 8 * 4096
    step, batch = step_program(graphdef, state, tx, OptimConfig(), steps=10, mesh=mesh, batch_size=1, seq_len=seq)
    step.trace(state, batch).lower().compile(compiler_options=dump_options(tmp_path))
    values = " ".join(shapes for _, shapes in largest_buffers(tmp_path, n=10**6))
    layers, local, d = cfg.num_layers, seq // 8, cfg.hidden
    assert f"f32[{layers},1,{local},{d}]" in values  # the saved inputs, float32 in this model
    assert f"f32[{d},{layers},1,{local}]" not in values  # ...and no transposed copy of them


def test_optimizer_offload_puts_the_state_in_host_memory():
    """--optim.offload --optim.master-weights --param-dtype bfloat16, compiled for 8 H100s: the float32 master
    weights and AdamW moments are host arguments of the step (aliased to its outputs), the device holds the bfloat16
    parameters, and the plan prints the PCIe traffic."""
    from ulysses_jax.plan.report import format_plan
    from ulysses_jax.train.step import OptimConfig

    base = dict(preset="tiny", seq_len=8192, batch_size=1, mesh=MeshConfig(fsdp=1, sp=8), attention="pallas",
                param_dtype="bfloat16", kernels=False)
    on_device = plan(PlanConfig(**base, optim=OptimConfig(master_weights=True)), detail=False)
    offloaded = plan(PlanConfig(**base, optim=OptimConfig(master_weights=True, offload=True)), detail=False)
    opt = offloaded.breakdown["optimizer"]
    assert opt == on_device.breakdown["optimizer"]
    assert 0 <= opt - 6 * offloaded.breakdown["parameters"] <= 16  # 3 float32 copies of bf16 parameters, 2 counts
    assert offloaded.optimizer_on_host and not on_device.optimizer_on_host
    # one copy of the state (its step counts stay on the device)
    assert on_device.memory["host_bytes"] == 0 and opt - 16 <= offloaded.memory["host_bytes"] <= 1.02 * opt
    assert offloaded.memory["argument_bytes"] <= on_device.memory["argument_bytes"] - opt + 16  # counts stay
    assert offloaded.memory["total_bytes"] < on_device.memory["total_bytes"] - opt // 2  # less what streams
    assert offloaded.memory["host_transfer_bytes"] == 2 * opt and on_device.memory["host_transfer_bytes"] == 0
    assert "in pinned host memory" in format_plan(offloaded) and "host link floor" in format_plan(offloaded)


def test_host_traffic_counts_the_kept_attention_that_remat_offload_sends():
    """--remat offload --attn-keep sends each layer's kept attention output (bf16) and log-sum-exp (float32) to host
    memory and back, beside its input: the PCIe floor counted the inputs alone (found by a review)."""
    from ulysses_jax.plan.planner import host_transfer_bytes

    cfg, mesh, seq = PlanConfig(preset="llama3.2-1b"), dict(data=1, fsdp=1, ring=1, sp=1), 32768
    model = ModelConfig.from_preset("llama3.2-1b", remat="offload")
    inputs = host_transfer_bytes(cfg, model, mesh, seq, 1, 0)
    kept = host_transfer_bytes(cfg, dataclasses.replace(model, attn_keep=True), mesh, seq, 1, 0)
    assert inputs == 2 * 16 * seq * 2048 * 2  # 16 layer inputs of [S, 2048] bf16, out and back: 4 GiB
    assert kept - inputs == 2 * 16 * seq * 32 * (64 * 2 + 4)  # 32 heads of 64: the output and the log-sum-exp


def test_offload_params_is_refused_by_plan_with_the_reason():
    """Compile-only GPUs have no memory kinds, so the layers' gradients cannot be typed as host memory there: plan
    says so instead of printing a program that would keep them on the device (tests/test_gpu.py checks a real GPU)."""
    from ulysses_jax.train.step import OptimConfig

    cfg = PlanConfig(preset="tiny", seq_len=4096, batch_size=1, mesh=MeshConfig(fsdp=1, sp=8), offload_params=True,
                     optim=OptimConfig(offload=True), kernels=False)
    with pytest.raises(ValueError, match=r"plan cannot compile --offload-params for compile-only GPUs yet"):
        plan(cfg)


@pytest.mark.parametrize("fields, message", [
    (dict(steps=0), r"^--steps \(0\) must be at least 1$"),  # it named --optim.decay-steps, not given
    (dict(grad_accum=0), r"^--grad-accum \(0\) must be at least 1$"),  # a ZeroDivisionError and exit 1 (OVER)
    (dict(steps=24, optim=dict(warmup_steps=100)), r"^--optim.warmup-steps \(100\) must be below the decay steps"),
])
def test_plan_refuses_what_train_refuses(fields, message):
    """Inputs `train` refuses in one line, `plan` refuses alike, before compiling (found by a review: plan printed
    `--optim.warmup-steps 100` as the flags to train the planned program with, which `train` then refused)."""
    from ulysses_jax.train.step import OptimConfig

    fields = {k: OptimConfig(**v) if k == "optim" else v for k, v in fields.items()}
    cfg = PlanConfig(preset="tiny", seq_len=4096, mesh=MeshConfig(fsdp=1, sp=8), kernels=False, **fields)
    with pytest.raises(ValueError, match=message):
        plan(cfg)


def _step_memory(cfg: ModelConfig, *, seq: int, optim=None, dump=None):
    """XLA's memory figures of ``cfg``'s train step (batch 1) on one compile-only H100."""
    from ulysses_jax.train.step import (
        BATCH_KEYS,
        OptimConfig,
        abstract_state,
        batch_sharding,
        make_optimizer,
        make_schedule,
        make_train_step,
    )

    optim = optim or OptimConfig()
    mesh = make_mesh(fsdp=1, devices=target_devices("h100", devices=1))
    tx = make_optimizer(optim, 10)
    graphdef, state = abstract_state(cfg, mesh, tx)
    step = make_train_step(graphdef, tx, make_schedule(optim, 10), mesh, jax.tree.map(lambda x: x.sharding, state))
    batch = {k: jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=batch_sharding(mesh)) for k in BATCH_KEYS}
    compiled = step.trace(state, batch).lower().compile(compiler_options=None if dump is None else dump_options(dump))
    return compiled.memory_analysis(), (graphdef, state, batch)


WIDE = dict(name="wide", vocab_size=256, num_layers=4, hidden=1024, num_heads=8, num_kv_heads=2, head_dim=128,
            mlp_dim=4096, param_dtype="bfloat16", compute_dtype="bfloat16", attention_impl="pallas", loss_chunk=1024,
            mlp_chunk=1024)


def test_streamed_update_writes_the_layers_parameters_in_place(monkeypatch):
    """--optim.offload: the update's new layer parameters go into the donated stacks, not into new zeros buffers (XLA
    created those with the gradients' before the backward and held them through it: 15 GiB on one H100 for
    Llama-3.1-8B). The step's temporaries are then those of the gradient alone plus one layer's float32 state in
    and out (6 x 4 bytes per parameter of a layer: 12/32 of the bf16 stack of 32 layers), not one stack more; and
    the new state in host memory is written into the donated state, not into a second copy of it. The loop over the
    layers (the state kept by layer) needs no more device memory than the scan over the stacked state: it needed
    499 MiB against 363 here when each layer's gradient was sliced before the chain's barrier (XLA made every layer's
    slice at once, ahead of the loop) and the in-place writes of the new parameters into their stacks were left to
    the end of the program (each layer's float32 weights alive until then); 0.88 GiB more for Qwen3-8B at 32K."""
    from ulysses_jax.train import optimizer
    from ulysses_jax.train.step import OptimConfig, _loss_sums

    cfg = ModelConfig(**{**WIDE, "num_layers": 32, "hidden": 512, "num_heads": 4, "mlp_dim": 2048, "remat": "full"})
    optim, seq = OptimConfig(master_weights=True, offload=True), 2048
    mem, (graphdef, state, batch) = _step_memory(cfg, seq=seq, optim=optim)
    stacked = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state["params"]["blocks"]))
    grad = jax.jit(jax.grad(lambda p, b: _loss_sums(graphdef, p, b)[0])).trace(state["params"], batch).lower()
    alone = grad.compile().memory_analysis()
    assert stacked > 200 * 2**20
    assert mem.temp_size_in_bytes < alone.temp_size_in_bytes + alone.output_size_in_bytes + 0.6 * stacked, (
        mem.temp_size_in_bytes, alone.temp_size_in_bytes, alone.output_size_in_bytes, stacked)
    # the state is kept by layer (optimizer.per_layer): each layer's new state goes back into the donated buffer it
    # came from. Stacked, the scan's outputs were new stacks: a second copy of the whole state in host memory (1,440
    # of 1,443 MiB at 1,024 tokens without remat; 77.6 GiB for Qwen3-8B, beyond the lent machine's 128 GiB)
    host_state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state["opt_state"]))
    assert mem.host_argument_size_in_bytes >= host_state - 16 and mem.host_temp_size_in_bytes < 0.02 * host_state, (
        mem.host_temp_size_in_bytes, host_state)
    monkeypatch.setattr(optimizer, "layered", lambda tx, offload_params: False)  # the stacked state and its scan
    scanned, _ = _step_memory(cfg, seq=seq, optim=optim)
    assert mem.temp_size_in_bytes < scanned.temp_size_in_bytes + 0.02 * stacked, (
        mem.temp_size_in_bytes, scanned.temp_size_in_bytes, stacked)
    assert scanned.host_temp_size_in_bytes > 0.9 * host_state  # (the second copy, which the loop has not)


def test_the_unrolled_update_holds_few_layers_states_on_the_device_at_once(monkeypatch):
    """--optim.offload with the state kept by layer: the update's loop is unrolled, and each layer waits for the
    outputs of the layer ``IN_FLIGHT`` (2) before it. Without that chain XLA's scheduler brings several layers' float32
    state to the device at once: on one compile-only H100, 8 layers of width 1024 at 128 tokens (where the update is
    the peak) took 744 MiB of device temporaries unchained against 564 chained, more than one layer's float32 master
    weights and moments (174 MiB) apart; Mixtral-8x7B at 1M tokens on 8 H100s, 46.22 GiB against 41.74."""
    from ulysses_jax.train import optimizer

    cfg = ModelConfig(**{**WIDE, "num_layers": 8, "mlp_chunk": 0, "loss_chunk": 0})
    optim = OptimConfig(master_weights=True, offload=True)
    assert optimizer.IN_FLIGHT == 2
    chained, (_, state, _) = _step_memory(cfg, seq=128, optim=optim)
    monkeypatch.setattr(optimizer, "IN_FLIGHT", 10**6)
    unchained, _ = _step_memory(cfg, seq=128, optim=optim)
    layer_state = 6 * sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state["params"]["blocks"])) // 8
    assert unchained.temp_size_in_bytes - chained.temp_size_in_bytes > 0.75 * layer_state, (
        chained.temp_size_in_bytes, unchained.temp_size_in_bytes, layer_state)


def test_the_host_optimizers_first_state_is_made_into_host_memory():
    """--optim.offload: the optimizer state's ``init`` moves each float32 master weight and moment to host memory as it
    makes it, so the device holds a few at a time (on a compile-only H100, where shardings carry no memory kind, the
    whole state was the device's output: 1.4 GiB here, 91.5 GiB for Qwen3-8B, beside an H100's 80)."""
    from ulysses_jax.train.step import _opt_init, abstract_state, make_optimizer

    cfg = ModelConfig(**{**WIDE, "num_layers": 32, "hidden": 512, "num_heads": 4, "mlp_dim": 2048})
    mesh = make_mesh(fsdp=1, devices=target_devices("h100", devices=1))
    tx = make_optimizer(OptimConfig(master_weights=True, offload=True), 10)
    _, state = abstract_state(cfg, mesh, tx)
    init, _ = _opt_init(tx, cfg, state["params"], jax.tree.map(lambda x: x.sharding, state["params"]))
    out = jax.tree.map(lambda x: x.sharding, state["opt_state"])
    mem = jax.jit(init, out_shardings=out).trace(state["params"]).lower().compile().memory_analysis()
    host_state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state["opt_state"]))
    assert mem.host_output_size_in_bytes >= host_state - 16, (mem.host_output_size_in_bytes, host_state)
    assert mem.output_size_in_bytes + mem.temp_size_in_bytes < 0.25 * host_state, (mem.temp_size_in_bytes, host_state)


def test_head_groups_shrink_the_kernels_buffers(tmp_path):
    """--attn-head-chunk on one H100: the Pallas kernels run on one group's heads ([1, S, h, 128] for h query heads
    per group; only the output is kept whole, [1, S, 8, 128]), and the device's temporaries shrink as the groups
    get smaller."""
    from ulysses_jax.plan.planner import largest_buffers

    seq, temps = 32768, {}
    for heads in (0, 4, 1):
        cfg = ModelConfig(**WIDE, remat="full", attn_chunk=4096, attn_head_chunk=heads)
        dump = tmp_path / str(heads)
        temps[heads] = _step_memory(cfg, seq=seq, dump=dump)[0].temp_size_in_bytes
        values = " ".join(shapes for _, shapes in largest_buffers(dump, n=10**6))
        assert f"bf16[1,{seq},{heads or 8},128]" in values
    q_bytes = seq * 8 * 128 * 2  # the whole sequence's Q of the device's 8 heads: 64 MiB
    assert temps[0] > temps[4] > temps[1] and temps[0] - temps[1] > q_bytes, temps


def test_remat_nested_moves_a_groups_layer_inputs_to_host_memory():
    """--remat offload --remat-every 2 --remat-nested on one compile-only H100: a group's backward sends its layers'
    inputs to pinned host memory instead of holding them on the device: host memory grows by the group's layer
    inputs, the device's temporaries shrink."""
    seq = 32768
    layer_input = seq * WIDE["hidden"] * 2  # bf16 [1, S, D]: 64 MiB
    figures = {}
    for nested in (False, True):
        cfg = ModelConfig(**WIDE, remat="offload", remat_every=2, remat_nested=nested)
        mem = _step_memory(cfg, seq=seq)[0]
        figures[nested] = (mem.temp_size_in_bytes, mem.host_temp_size_in_bytes)
    (temp, host), (temp_nested, host_nested) = figures[False], figures[True]
    assert host_nested - host >= layer_input, figures  # the group's layer inputs: 2 x 64 MiB here
    assert temp_nested < temp, figures  # by 28 MiB at this size (the peak moves elsewhere in the step)


TRAIN_ARGS_CASES = {
    "plain": dict(),
    "host optimizer": dict(remat="offload", param_dtype="bfloat16", optim=OptimConfig(master_weights=True,
                                                                                        offload=True)),
    "tiled attention": dict(remat="full", attn_chunk=512, attn_head_chunk=1, loss_chunk=512, mlp_chunk=512),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=[] if c == "host optimizer" else [pytest.mark.slow])
                                  for c in TRAIN_ARGS_CASES])
def test_train_args_compile_the_planned_program(case):
    """The plan's ``train_args`` parsed by the real CLI parser, the step built from them as ``setup_train`` builds it
    (model, mesh, batch, resolved optimizer, ``program.step_program``) on the same compile-only H100s: its optimised
    HLO is the one ``plan`` compiled (fingerprints of the HLO without source metadata, and the text itself)."""
    from ulysses_jax.cli import parse
    from ulysses_jax.data.tokenizers import make_tokenizer
    from ulysses_jax.plan.hlo import fingerprint
    from ulysses_jax.train.config import TrainConfig, build_mesh, check_parallel, model_config, resolve_batch
    from ulysses_jax.train.program import optimizer_of, step_program
    from ulysses_jax.train.step import abstract_state

    cfg = PlanConfig(preset="tiny", seq_len=4096, steps=7, mesh=MeshConfig(fsdp=2, sp=4), attention="pallas",
                     kernels=False, **TRAIN_ARGS_CASES[case])
    p = plan(cfg, detail=False)
    train = parse(["train", *p.train_args])
    assert type(train) is TrainConfig and train.memory_fraction == p.memory_fraction == 0.95
    model = model_config(train, make_tokenizer(train.tokenizer).vocab_size)
    mesh = build_mesh(train.mesh, model, train.seq_len, devices=target_devices("h100", devices=8))
    batch_size = resolve_batch(train.batch_size, mesh, train.grad_accum)
    check_parallel(model, mesh, seq_len=train.seq_len, batch_size=batch_size, grad_accum=train.grad_accum)
    optim = train.optim.resolved(train.steps)
    tx = optimizer_of(optim, train.steps)
    graphdef, state = abstract_state(model, mesh, tx, train.seed)
    step, batch = step_program(graphdef, state, tx, optim, steps=train.steps, mesh=mesh, batch_size=batch_size,
                               seq_len=train.seq_len, grad_accum=train.grad_accum)
    text = step.trace(state, batch).lower().compile().as_text()
    assert fingerprint(text) == p.hlo_fingerprint
    assert ("--optim.offload" in p.train_args) == (case == "host optimizer") and "--steps" in p.train_args
    # the host optimizer's note (other notes, such as XLA's copies of parameters into another layout, may come too)
    assert any(n.startswith("--optim.offload") for n in p.notes) == (case == "host optimizer"), p.notes


def test_train_args_keep_the_window():
    """`--sliding-window` shapes the program (which layers see how far): the plan's train flags carry it, so `train`
    compiles the planned program (they dropped it: found by a review)."""
    from ulysses_jax.cli import parse
    from ulysses_jax.plan.flags import train_args

    cfg = PlanConfig(preset="llama3.2-1b", seq_len=8192, batch_size=1, sliding_window=1024)
    args = train_args(cfg, seq_len=8192, batch_size=1, mesh=dict(data=1, fsdp=1, ring=1, sp=2), memory_fraction=0.95)
    assert args[args.index("--sliding-window") + 1] == "1024" and parse(["train", *args]).sliding_window == 1024


def test_a_compile_failure_is_its_own_exit_status(monkeypatch, capsys):
    """XLA failing to compile the step is no verdict: one line, exit 4 (not 1, OVER, which scripts act on)."""
    import jax

    from ulysses_jax import cli
    from ulysses_jax.plan import run

    def fail(cfg):
        raise jax.errors.JaxRuntimeError("INTERNAL: during context [end-of-post-layout_assignment]: Expected ...")

    monkeypatch.setattr(run, "run_plan", fail)
    assert cli.main(["plan", "--preset", "tiny", "--no-kernels"]) == cli.EXIT_NO_PROGRAM == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: XLA could not compile this step for h100 (INTERNAL"), err


def test_a_moe_plan_lists_its_grouped_matmul_kernels(capsys):
    """The planned step of a mixture of experts runs its experts as our grouped matmul kernels (forward, dX, dW), which
    the plan lists with their ptxas figures beside the attention kernels."""
    from ulysses_jax import cli

    assert cli.main(["plan", "--preset", "tiny-moe", "--devices", "1", "--mesh.sp", "1", "--mesh.fsdp", "1",
                     "--seq-len", "1024", "--batch-size", "1", "--attention", "pallas"]) == 0
    out = capsys.readouterr().out
    listed = out[out.index("Pallas kernels"):]
    for name in ("flash_attention_fwd", "grouped_matmul ", "grouped_matmul_dx", "grouped_matmul_dw"):
        assert f"\n  {name}" in listed, (name, listed[:800])


def test_train_args_carry_the_data_flags_and_an_over_plan_says_so_first():
    import types

    from ulysses_jax.cli import parse
    from ulysses_jax.plan.flags import train_args
    from ulysses_jax.plan.report import train_command_lines
    from ulysses_jax.train.config import TrainConfig

    cfg = TrainConfig(data=("corpus.jsonl", "more.jsonl"), data_format="sft", tokenizer="tok.json")
    args = train_args(cfg, seq_len=1024, batch_size=2, mesh=dict(data=1, fsdp=1, ring=1, sp=8), memory_fraction=0.95)
    back = parse(["train", *args])
    assert back.data == ("corpus.jsonl", "more.jsonl") and back.data_format == "sft" and back.tokenizer == "tok.json"
    assert "--data" not in train_args(TrainConfig(), seq_len=1024, batch_size=2,
                                      mesh=dict(data=1, fsdp=1, ring=1, sp=8), memory_fraction=0.95)

    def tail(fits, given):  # the report's last block (format_plan ends with it; the rest needs a compiled plan)
        return "\n".join(train_command_lines(types.SimpleNamespace(train_args=given, fits=fits)))

    over = tail(False, ["--seq-len", "8"])
    assert "does NOT fit" in over and "Train the planned program with" not in over
    assert "(no --data given to plan" in over and "(no --data" not in tail(True, ["--data", "x.jsonl"])


def test_the_nearest_measured_row_is_of_the_same_gpu_and_model():
    from ulysses_jax.plan.measured import ROWS, nearest

    near = nearest("h200", "llama3.2-1b", 30000, flags="--remat full")
    assert (near.gpu, near.preset, near.mode, near.seq_len) == ("h200", "llama3.2-1b", "full", 32768)
    assert nearest("h200", "llama3.2-1b", 30000, lora=True).mode == "lora16"
    assert nearest("h100", "llama3.2-1b", 32768, flags="--attention pallas").flags.startswith("--attention pallas")
    assert nearest("h100", "qwen3-8b", 32768) is None
    one = "--remat save_matmuls --attn-keep --loss-chunk 4096 --mlp-chunk 0 --attn-max-documents 1"
    assert nearest("h200", "llama3.2-1b", 32768, flags=one).step_s == 1.040  # of two rows alike, the newer program's
    assert "measured (experiments/results/" in near.describe() and all(r.step_s > 0 for r in ROWS)
    import pathlib

    root = pathlib.Path(__file__).parents[1]
    assert all((root / r.source).is_file() for r in ROWS)  # each row is a committed result


def test_peak_names_the_values_alive_where_device_memory_peaks(tmp_path):
    """``plan/peak.py`` on a program compiled for a compile-only H100 whose peak is known: three arrays made together
    (64, 32 and 16 MiB) and alive at once, each with the JAX op that made it; the input (a parameter: the state) left
    out."""
    from ulysses_jax.plan.peak import peak

    def f(x):
        a, b, c = jax.lax.optimization_barrier((jnp.sin(x), jnp.cos(x[:, :2048]), jnp.exp(x[:1024])))
        return jnp.sum(a) * jnp.sum(b) + jnp.sum(c)

    x = jax.ShapeDtypeStruct((4096, 4096), jnp.float32,
                             sharding=jax.sharding.SingleDeviceSharding(target_devices("h100", devices=1)[0]))
    jax.jit(f).trace(x).lower().compile(compiler_options=dump_options(tmp_path))
    found = peak(tmp_path)
    assert found is not None and 0 <= found.position < found.length
    shapes = [v.shape.split("{")[0] for v in found.values[:3]]
    assert shapes == ["f32[4096,4096]", "f32[4096,2048]", "f32[1024,4096]"], found.values
    assert all(v.op.startswith("jit(f)/") for v in found.values[:3]), found.values
    assert found.live_bytes >= 112 * 2**20 and found.heap_bytes >= found.live_bytes
    assert peak(tmp_path / "nothing") is None
