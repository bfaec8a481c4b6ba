"""MoE sharding at long context: gather the experts (FSDP, what the project does) or move the tokens (expert parallel)?

No GPU needed and no time measured. With the CUDA plugin (the ``aot`` extra) XLA compiles, for 8 compile-only H100s on
one host, forward + backward (``jax.value_and_grad`` of ``sum(out * g)``, ``g`` a random cotangent, in x, the router
and the three expert weights) of ONE sparse layer of Qwen3-30B-A3B (hidden 2048, 128 experts, top-8, expert width 768,
bf16 compute, float32 weights at rest) on ``T`` tokens per device, for two designs:

  gather  ``ulysses_jax.model.moe.moe_sublayer`` on ``make_mesh(fsdp=1, sp=8)``: weights at rest split over their
          ``embed`` dimension (``param_spec``), all-gathered inside ``shard_map``, gradients reduce-scattered; tokens
          never leave their device.
  ep      expert parallel: each device owns 128 / 8 = 16 experts whole (weights at rest split over the experts). Tokens
          are routed on their device, the token-expert pairs sorted by expert and sent to their expert's device with
          ``jax.lax.ragged_all_to_all`` (sizes exchanged by a small all-gather of the per-expert counts), run through
          the same Pallas grouped matmul there, and sent back by a second ragged all-to-all. The receive buffer holds
          ``recv_factor x T x k`` rows (default 1.0: the perfectly balanced share, so a LOWER bound on EP's memory; a
          dropless buffer needs up to 8x that). The router and the norm scale are gathered like the project's.

For each: per-device collective bytes per kind from ``ulysses_jax.plan.hlo.collectives`` (the HLO's buffers, loop
trips counted), the bytes a ragged all-to-all sends (its operand: ``hlo.collectives`` counts the larger of what the
op takes and what it gives, and a ragged all-to-all takes its output buffer as an operand too, so it reads as
operand + buffer), ``memory_analysis()`` and an NVLink estimate (bytes / 450 GB/s, nothing overlapped, not a measured
time). Writes ``experiments/results/moe_sharding_h100.md``.

    JAX_PLATFORMS=cpu python experiments/moe_sharding.py [--tokens 131072 8192] [--recv-factor 1.0]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin registers without a GPU only then

D, E, K, F = 2048, 128, 8, 768  # Qwen3-30B-A3B: hidden, experts, top-k, expert width
N_DEV = 8
NVLINK = 450e9  # B/s per GPU, one direction (H100 SXM, nominal)
EXPERT_BYTES = 3 * E * D * F * 2  # one layer's gate, up and down in bf16: what the gather moves each time
NOTES = [
    ("- `jax.lax.ragged_all_to_all` compiles for the H100 target in jax 0.10.2 (async "
     "`ragged-all-to-all-start/done`; its transpose is again a ragged all-to-all plus two all-to-alls of the "
     "offsets, the `all-to-all` column). XLA:CPU cannot run it, so the EP code was checked on 8 CPU devices with "
     "an all-gather emulation of its documented semantics against `moe_sublayer` (float32, 16 experts top-4, "
     "dropless buffer): loss and gradients agree to 1.1e-6 relative (`--check`)."),
    ("- EP's figures are a lower bound. The receive buffer is the balanced share (T x k rows): a dropless EP must size "
     "it for the worst case (up to 8 x T x k rows, 32 GiB at T = 131,072) or drop pairs, and with real routing the "
     "most loaded device receives more than its share and sets the pace. Gather's bytes do not depend on routing."),
    ("- Both columns count the whole buffer, the device's own 1/8 included: what crosses NVLink is 7/8 of it for "
     "both designs (ring all-gather / reduce-scatter, all-to-all), so the ratios hold."),
    ("- Temp memory is one layer without `mlp_chunk`: gather's 20 GB at T = 131,072 are mostly the T x k "
     "token-expert pairs [T x k, 2048] and their [T x k, 768] activations, which the model's `mlp_chunk` cuts to "
     "one chunk's; EP holds those plus the send / receive buffers of both exchanges (38 GB). Under remat one layer "
     "alone has nothing to save, so its temp is not what remat saves in the model."),
    "- Ulysses attention's own all-to-alls are not included: they are the same for both designs.",
    "- Both programs run the Pallas grouped matmul's Triton kernels (`__gpu$xla.gpu.triton` custom calls).",
]
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")


def _cfg():
    from ulysses_jax.model.config import PRESETS

    cfg = dataclasses.replace(PRESETS["qwen3-30b-a3b"], moe_impl="pallas", mlp_chunk=0)
    assert (cfg.hidden, cfg.num_experts, cfg.experts_per_token, cfg.expert_mlp_dim) == (D, E, K, F)
    return cfg


def _exclusive_cumsum(x, axis=0):
    import jax.numpy as jnp

    return jnp.cumsum(x, axis=axis) - x


def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """``jax.lax.ragged_all_to_all``'s documented semantics from an all-gather and a gather (XLA:CPU has no
    ragged-all-to-all): for the CPU check only."""
    import jax
    import jax.numpy as jnp

    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)  # [source, rows, ...]
    src_in = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # where each source's chunk for me starts
    src_out = jax.lax.all_gather(output_offsets, axis_name)[:, me]  # where it lands in my output
    src_n = jax.lax.all_gather(send_sizes, axis_name)[:, me]
    r = jnp.arange(output.shape[0])[:, None]
    hit = (r >= src_out[None]) & (r < (src_out + src_n)[None])  # [rows, source]
    src = jnp.argmax(hit, axis=1)
    row = jnp.clip(src_in[src] + r[:, 0] - src_out[src], 0, operand.shape[0] - 1)
    got = ops[src, row]
    mask = hit.any(axis=1).reshape((-1,) + (1,) * (operand.ndim - 1))
    return jnp.where(mask, got, output)


def ep_local(cfg, recv_rows: int, impl: str, platform: str, x_bsD, norm_D, wr, wg, wu, wd, *, a2a=None):
    """One device's expert-parallel sparse sublayer: ``x + moe(rms_norm(x))`` with this device's 16 experts
    (``wg``/``wu`` ``[16, D, F]``, ``wd`` ``[16, F, D]``), the pairs moved by two ragged all-to-alls."""
    import jax
    import jax.numpy as jnp

    a2a = a2a or jax.lax.ragged_all_to_all
    from ulysses_jax.kernels.grouped_matmul import grouped_matmul
    from ulysses_jax.model.layers import mlp_activation, rms_norm
    from ulysses_jax.model.moe import route
    from ulysses_jax.parallel.mesh import SP
    from ulysses_jax.parallel.sharding import gather_param

    n, el = jax.lax.axis_size(SP), wg.shape[0]
    k, e = cfg.experts_per_token, cfg.num_experts
    norm_D, wr = gather_param(norm_D, 0), gather_param(wr, 0)
    d = x_bsD.shape[-1]
    x_tD = rms_norm(x_bsD, norm_D, cfg.rms_eps).reshape(-1, d)
    weights_tk, experts_tk, _ = route(x_tD, wr, k, cfg.router_renormalize)

    # dispatch: pairs sorted by global expert, hence by destination device (expert // el)
    flat_P = experts_tk.reshape(-1)
    order_P = jnp.argsort(flat_P, stable=True)
    xs_PD = jnp.take(x_tD, order_P // k, axis=0)
    gs_E = jnp.bincount(flat_P, length=e).astype(jnp.int32)
    counts = jax.lax.all_gather(gs_E, SP).reshape(n, n, el)  # [source, destination, local expert]
    sizes = counts.sum(2)  # [source, destination] pairs
    me = jax.lax.axis_index(SP)
    send_sizes, recv_sizes = sizes[me], sizes[:, me]
    send_offsets = _exclusive_cumsum(send_sizes)  # where my chunk for each destination starts in xs
    offsets_at_dest = _exclusive_cumsum(sizes, axis=0)[me]  # where my chunk lands in each destination's buffer
    recv_offsets = _exclusive_cumsum(recv_sizes)  # where each source's chunk lands in mine
    offsets_at_source = _exclusive_cumsum(sizes, axis=1)[:, me]  # where the source took my chunk from
    buf = jnp.zeros((recv_rows, d), xs_PD.dtype)
    xr_RD = a2a(xs_PD, buf, send_offsets, send_sizes, offsets_at_dest, recv_sizes,
                                      axis_name=SP)

    # received rows are source-major, local-expert-minor: regroup them by local expert for the grouped matmul
    recv_counts = counts[:, me, :]  # [source, local expert]
    ends = jnp.cumsum(recv_counts.reshape(-1))
    seg_R = jnp.searchsorted(ends, jnp.arange(recv_rows, dtype=ends.dtype), side="right")
    local_R = jnp.where(seg_R < n * el, seg_R % el, el)  # rows past the received ones last
    order_R = jnp.argsort(local_R, stable=True)
    group_sizes = recv_counts.sum(0).astype(jnp.int32)
    xg_RD = jnp.take(xr_RD, order_R, axis=0)

    def gmm(a, w):
        return grouped_matmul(a, w, group_sizes, impl=impl, platform=platform)

    act = mlp_activation(cfg)
    yg_RD = gmm(act(gmm(xg_RD, wg)) * gmm(xg_RD, wu), wd)
    yr_RD = jnp.take(yg_RD, jnp.argsort(order_R), axis=0)

    # combine: each chunk back to the device (and the place) it came from
    back = jnp.zeros_like(xs_PD)
    ys_PD = a2a(yr_RD, back, recv_offsets, recv_sizes, offsets_at_source, send_sizes,
                                      axis_name=SP)
    ys_tkD = jnp.take(ys_PD, jnp.argsort(order_P), axis=0).reshape(-1, k, d)
    y_tD = jnp.einsum("tkd,tk->td", ys_tkD, weights_tk.astype(ys_tkD.dtype))
    return x_bsD + y_tD.reshape(x_bsD.shape).astype(x_bsD.dtype)


def build(design: str, tokens: int, recv_factor: float, cfg=None, devices=None, remat: bool = False):
    """``(jitted grad fn, abstract args)`` of one layer's forward + backward for ``design``: Qwen3-30B-A3B's layer on
    8 compile-only H100s by default; ``cfg`` / ``devices`` for the CPU check (``check``). ``jax.value_and_grad``: with
    ``remat`` the forward runs for the loss and again in the backward, as a layer under ``jax.checkpoint`` in a
    training step does (``jax.grad`` alone would drop the first forward as dead code)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ulysses_jax.model.moe import moe_sublayer
    from ulysses_jax.parallel.mesh import DATA, FSDP, SEQ, SP, make_mesh
    from ulysses_jax.parallel.sharding import param_spec
    from ulysses_jax.plan.targets import target_devices

    cfg = cfg or _cfg()
    mesh = make_mesh(fsdp=1, sp=N_DEV, devices=devices or target_devices("h100", devices=N_DEV))
    platform = mesh.devices.flat[0].platform
    impl = "pallas" if platform == "gpu" else "ragged_dot"
    dt = cfg.compute_jnp_dtype
    d, e, f = cfg.hidden, cfg.num_experts, cfg.expert_mlp_dim
    seq = tokens * N_DEV
    act_spec = P((DATA, FSDP), SEQ, None)

    def sds(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    x = sds((1, seq, d), dt, act_spec)
    g = sds((1, seq, d), dt, act_spec)
    norm = sds((d,), jnp.float32, param_spec(("embed",)))
    wr = sds((d, e), jnp.float32, param_spec(("embed", "experts")))
    if design == "gather":
        specs = [param_spec(("experts", "embed", "mlp")), param_spec(("experts", "embed", "mlp")),
                 param_spec(("experts", "mlp", "embed"))]
    else:  # experts split over the devices, each expert whole
        specs = [P(SP, None, None)] * 3
    ws = [sds((e, d, f), jnp.float32, specs[0]), sds((e, d, f), jnp.float32, specs[1]),
          sds((e, f, d), jnp.float32, specs[2])]
    valid = sds((1, seq), jnp.int32, P((DATA, FSDP), SEQ))

    def layer(x, norm, wr, wg, wu, wd, valid):
        cast = tuple(w.astype(dt) for w in (wr, wg, wu, wd))  # as MoE.residual: at rest float32, gathered in bf16
        if design == "gather":
            out, _ = moe_sublayer(x, valid, norm, cast, cfg=cfg, mesh=mesh)
            return out
        rows = round(recv_factor * tokens * cfg.experts_per_token)
        a2a = ragged_all_to_all_emulated if platform == "cpu" else None
        fn = jax.shard_map(lambda *a: ep_local(cfg, rows, impl, platform, *a, a2a=a2a), mesh=mesh,
                           in_specs=(act_spec, param_spec(("embed",)), param_spec(("embed", "experts")), *specs),
                           out_specs=act_spec, check_vma=False)
        return fn(x, norm, *cast)

    def loss(x, norm, wr, wg, wu, wd, valid, g):
        out = (jax.checkpoint(layer) if remat else layer)(x, norm, wr, wg, wu, wd, valid)
        return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3, 4, 5))), (x, norm, wr, *ws, valid, g)


def check(tokens: int = 64) -> float:
    """EP against the project's gather design on 8 CPU devices, float32, 16 experts top-4, a dropless receive buffer
    (8 x T x k rows; XLA:CPU has no ragged all-to-all: ``ragged_all_to_all_emulated``
    stands in for it, checking the offsets and the regrouping): the largest relative difference of the loss and of
    the gradients."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ulysses_jax.model.config import PRESETS

    cfg = dataclasses.replace(PRESETS["tiny-moe"], num_experts=16, experts_per_token=4, mlp_chunk=0)
    devices = jax.devices("cpu")[:N_DEV]
    rng = np.random.default_rng(0)
    results = []
    for design in ("gather", "ep"):
        fn, abstract = build(design, tokens, float(N_DEV), cfg=cfg, devices=devices)
        rng = np.random.default_rng(0)
        vals = []
        for a in abstract:
            v = np.ones(a.shape, a.dtype) if a.dtype == np.int32 else rng.standard_normal(a.shape).astype(a.dtype)
            if len(a.shape) == 1:
                v = 1.0 + 0.1 * v  # the norm scale
            elif len(a.shape) == 3 and a.shape[0] == cfg.num_experts:
                v = v * 0.05
            vals.append(jax.device_put(jnp.asarray(v), a.sharding))
        results.append(jax.tree.leaves(fn(*vals)))
    worst = 0.0
    for a, b in zip(*results):
        a, b = np.asarray(a), np.asarray(b)
        worst = max(worst, float(np.max(np.abs(a - b)) / (np.max(np.abs(a)) + 1e-30)))
    return worst


def ragged_operand_bytes(hlo_text: str) -> int:
    """Bytes a program's ragged all-to-alls send per device: their first operand (the data), loop trips counted."""
    from ulysses_jax.plan import hlo

    comps, entry = hlo.parse(hlo_text)
    mult = hlo.multiplicities(comps, entry)
    total = 0
    for name, instrs in comps.items():
        types = {i.name: i.type for i in instrs}
        for ins in instrs:
            if ins.opcode in ("ragged-all-to-all", "ragged-all-to-all-start") and mult.get(name, 0):
                total += mult[name] * hlo.array_bytes(types.get(ins.operands[0], ""))
    return total


def measure(design: str, tokens: int, recv_factor: float, remat: bool = False) -> dict:
    from ulysses_jax.plan import hlo

    fn, args = build(design, tokens, recv_factor, remat=remat)
    start = time.perf_counter()
    compiled = fn.trace(*args).lower().compile()
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    colls = hlo.collectives(text, devices_per_host=N_DEV, num_devices=N_DEV)
    mem = compiled.memory_analysis()
    by_kind = {kind: (colls[kind].bytes if kind in colls else 0) for kind in KINDS}
    counts = {kind: colls[kind].count for kind in colls}
    hlo_total = hlo.total_bytes(colls)
    ragged_sent = ragged_operand_bytes(text)
    ragged_hlo = by_kind["ragged-all-to-all"]
    moved = hlo_total - ragged_hlo + ragged_sent  # ragged all-to-alls at what they send
    pairs = tokens * K
    # no remat: gather forward + reduce-scatter backward; EP dispatch + combine, each transposed in the backward.
    # Remat (the layer recomputed in the backward) repeats the forward's collectives.
    formula = (4 + 2 * remat) * pairs * D * 2 if design == "ep" else (2 + remat) * EXPERT_BYTES
    return {"design": design + (" (remat)" if remat else ""), "tokens/device": tokens, "remat": remat,
            "by_kind": by_kind, "counts": counts, "hlo_total": hlo_total,
            "ragged_sent": ragged_sent, "moved": moved, "formula": formula,
            "nvlink_ms": moved / NVLINK * 1e3, "argument": mem.argument_size_in_bytes,
            "output": mem.output_size_in_bytes, "temp": mem.temp_size_in_bytes, "compile_s": seconds}


def _gb(b: float) -> str:
    return f"{b / 1e9:.3f}"


def table(rows: list[dict]) -> list[str]:
    cols = ["design", "tokens/device", *[f"{k} GB" for k in KINDS if any(r["by_kind"][k] for r in rows)],
            "total (hlo.collectives) GB", "total, ragged at bytes sent GB", "formula GB",
            "NVLink estimate ms (bytes / 450 GB/s)", "argument GB", "temp GB"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["design"], f"{r['tokens/device']:,}"]
        cells += [_gb(r["by_kind"][k]) + (f" ({r['counts'][k]}x)" if r["by_kind"][k] else "")
                  for k in KINDS if any(x["by_kind"][k] for x in rows)]
        cells += [_gb(r["hlo_total"]), _gb(r["moved"]), _gb(r["formula"]), f"{r['nvlink_ms']:.1f}",
                  _gb(r["argument"]), _gb(r["temp"])]
        out.append("| " + " | ".join(cells) + " |")
    return out


def conclusion(rows: list[dict]) -> list[str]:
    by = {(r["design"].split()[0], r["tokens/device"], r["remat"]): r for r in rows}
    lines = []
    for remat in (False, True):
        for t in sorted({r["tokens/device"] for r in rows}, reverse=True):
            g, e = by.get(("gather", t, remat)), by.get(("ep", t, remat))
            if not (g and e):
                continue
            few, many = (g, e) if g["moved"] <= e["moved"] else (e, g)
            lines.append(f"- {t:,} tokens per device ({t * N_DEV:,} in all){', remat' if remat else ''}: "
                         f"{few['design']} moves {_gb(few['moved'])} GB per device per layer (fwd+bwd), "
                         f"{many['design']} {_gb(many['moved'])} GB: {many['moved'] / few['moved']:.1f}x fewer bytes "
                         f"with {few['design'].split()[0]} (NVLink estimates {few['nvlink_ms']:.1f} vs "
                         f"{many['nvlink_ms']:.1f} ms at 450 GB/s; temp {_gb(few['temp'])} vs {_gb(many['temp'])} GB).")
    cross = 2 * EXPERT_BYTES / (4 * K * D * 2)
    cross3 = 3 * EXPERT_BYTES / (4 * K * D * 2)
    lines.append(f"- Crossover (formulas, which the measured bytes match to 0.1%): EP sends 4 x T x k x D x 2 B per "
                 f"layer (dispatch and combine, each transposed in the backward), gather moves the layer's bf16 "
                 f"experts ({_gb(EXPERT_BYTES)} GB) twice (all-gather, reduce-scatter of the gradient). Equal at "
                 f"T = {cross:,.0f} tokens per device. Under remat both repeat their forward collectives (gather 3x, "
                 f"EP 6 x T x k x D x 2 B): the same T = {cross:,.0f}. A remat that re-gathers the experts but keeps "
                 f"EP's exchanged pairs (gather 3x, EP 4x) moves it to T = {cross3:,.0f}. Above it gather moves "
                 f"fewer bytes; at 1M tokens on 8 GPUs (T = 131,072) by 7x.")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[131072, 32768, 16384, 8192],
                        help="tokens per device")
    parser.add_argument("--remat-tokens", type=int, nargs="*", default=[131072, 8192],
                        help="token counts also compiled with the layer under jax.checkpoint (recomputed in the bwd)")
    parser.add_argument("--designs", nargs="+", default=["gather", "ep"], choices=["gather", "ep"])
    parser.add_argument("--recv-factor", type=float, default=1.0,
                        help="EP receive buffer rows as a multiple of T x k (1.0: the balanced share)")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "moe_sharding_h100.md"))
    parser.add_argument("--check", action="store_true",
                        help="only check EP against the gather design on 8 CPU devices (float32, small)")
    args = parser.parse_args(argv)
    if args.check:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N_DEV}"
        worst = check()
        print(f"EP vs gather on {N_DEV} CPU devices: largest relative difference of loss and gradients {worst:.2e}")
        return 0 if worst < 1e-4 else 1

    import jax

    rows = []
    runs = [(t, False) for t in args.tokens] + [(t, True) for t in args.remat_tokens]
    for t, remat in runs:
        for design in args.designs:
            r = measure(design, t, args.recv_factor, remat)
            print({k: v for k, v in r.items()}, flush=True)
            rows.append(r)
    lines = table(rows)
    concl = conclusion(rows)
    print("\n".join(lines + [""] + concl))

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False, cwd=pathlib.Path(__file__).parent).stdout.strip() or "unknown"
    used = ["ulysses_jax/model/moe.py", "ulysses_jax/kernels/grouped_matmul.py", "ulysses_jax/plan/hlo.py"]
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *used], capture_output=True, text=True,
                           check=False, cwd=pathlib.Path(__file__).parent.parent).stdout.split()[1::2]
    command = "JAX_PLATFORMS=cpu python experiments/moe_sharding.py " + " ".join(sys.argv[1:])
    text = [
        "# MoE sharding at long context: gather the experts (FSDP) or move the tokens (expert parallel)", "",
        "- date: 2026-11-26",
        ("- hardware: compile-only NVIDIA H100 x 8, no GPU: bytes and memory read from the compiled programs, no time "
         "measured"),
        f"- jax: {jax.__version__}",
        f"- command: `{command.strip()}`",
        f"- commit: `{commit}`" + (f" (with uncommitted changes to {', '.join(dirty)})" if dirty else ""),
        ("- layer: Qwen3-30B-A3B sparse MLP (hidden 2048, 128 experts, top-8, expert width 768), bf16 compute, "
         "float32 weights at rest; forward + backward of one layer (`jax.value_and_grad` of `sum(out * g)` in x, "
         "router, gate, up, down), without and with `jax.checkpoint` on the layer (remat); mesh fsdp=1 x sp=8 on one "
         "host"),
        f"- EP receive buffer: {args.recv_factor} x T x k rows (1.0 = the balanced share; dropless needs up to 8x)",
        "",
        ("Per device, per layer (forward + backward). Collective columns: `hlo.collectives` bytes (the larger of each "
        "op's input and output buffer, so the whole gathered / scattered / exchanged buffer, the device's own share "
        "included: 8/7 of what crosses NVLink) and the number of ops. A ragged all-to-all takes its output buffer as "
        "an operand, so `hlo.collectives` counts it as data + buffer; the next column counts it at the data it sends "
        "(its operand). The NVLink estimate is that column / 450 GB/s, nothing overlapped: an estimate, not a "
        "measured time. Formula: gather 2 x 1.208 GB (all-gather + reduce-scatter of the bf16 experts), 3 x with "
        "remat; EP 4 x T x k x D x 2 B, 6 x with remat."), "",
        *lines, "", "## Conclusion", "", *concl, "", "## Notes", "", *NOTES, "",
    ]
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(text))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
