"""Where one training step's time goes: a `jax.profiler` trace of N steps, every device op sorted into a category, the
categories summing to the measured step (idle gaps included), beside `plan`'s estimate of the same parts.

    python experiments/profile_step.py --preset llama3.2-1b --seq-lens 32768 --attn-keep
    python experiments/profile_step.py --preset llama3.1-8b --seq-lens 32768 --lora-rank 16 --plan-json P.json
    python experiments/profile_step.py --allow-cpu --quick          # CPU dry run (XLA's CPU ops; times mean nothing)
    python experiments/profile_step.py --from-ops results/profile_X.ops.json.gz   # a stored profile, categorised anew

The step is `experiments/bench_train.py`'s (its flags are this script's). A device op is one the trace tags with
`hlo_op` (XLA's instruction): its category comes from the compiled program's HLO, in this order of precedence:
- attention forward / backward: cuDNN's fused attention custom calls, our Pallas attention kernels;
- collectives: all-to-all, all-gather, reduce-scatter, all-reduce, collective-permute;
- host transfers: copies to or from host memory (remat offload, the streamed optimizer), and memcpy events;
- optimizer update, tiled loss, MLP chunks: ops under the `optimizer`, `loss` and `mlp` named scopes of the model;
- GEMMs: the other matmuls (the attention projections, the unembedding outside the loss);
- elementwise and copies: everything else (norms, RoPE, residual adds, layout copies).
Two ops that overlap in time (a collective beside a kernel) count once, for the earlier category of that list, so the
categories and the idle gaps (no device op running) add up to the step measured on the host.
`--plan-json`: a `ulysses-jax plan --json` of the same flags (made on any machine) to print its estimate's parts
beside the measured ones, with the three largest differences. The table goes to --out-dir as markdown.
`--from-ops`: no GPU; a stored profile's op times (`*.ops.json.gz`, written beside each table) and compiled module
(`*.hlo.txt.gz`) categorised by this file's rules, written beside them as `*.by_category.md` (a profile taken before a
rule was added, e.g. the ops inside command buffers categorised by their fusion's name, is read again without a GPU).
Its sums add each op's time (no timestamps are stored, so two ops that overlapped count twice: the table prints the
sum beside the step the profile measured).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gzip
import json
import pathlib
import re
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CATEGORIES = ("attention forward", "attention backward", "collectives", "host transfers", "optimizer update",
              "tiled loss", "MLP chunks", "GEMMs", "elementwise and copies")
COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
# plan's estimate parts (ulysses_jax/plan/estimate.py) against the measured categories
PLAN_PARTS = {"attention_s": ("attention forward", "attention backward"),
              "matmul_s": ("GEMMs", "MLP chunks", "tiled loss"),
              "elementwise_s": ("elementwise and copies",), "update_s": ("optimizer update",),
              "collectives_exposed_s": ("collectives",), "host_optimizer_s": ("host transfers",)}

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"(?<![A-Za-z0-9_])([a-z][a-z0-9\-]*)\(")
_COMP = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")


def parse_args(argv=None):
    import bench_train

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[], add_help=True)
    p.add_argument("--profile-steps", type=int, default=3, help="steps traced (after --warmup)")
    p.add_argument("--plan-json", type=pathlib.Path, default=None)
    p.add_argument("--from-ops", type=pathlib.Path, default=None, help="a stored *.ops.json.gz: categorise it anew")
    known, rest = p.parse_known_args(argv)
    if known.from_ops:  # a stored profile: no step to build, so none of bench_train's flags
        return known
    args = bench_train.parse_args(rest)
    args.profile_steps, args.plan_json, args.from_ops = known.profile_steps, known.plan_json, None
    return args


def _scope(name: str, op_name: str) -> bool:
    """Whether ``op_name`` (XLA's metadata path) lies in the named scope ``name``: a path component ``name``, or one
    wrapped by a transformation (``jvp(name)``, ``transpose(jvp(name))``)."""
    return re.search(rf"(?:^|[/(]){re.escape(name)}(?:[/)]|$)", op_name) is not None


def hlo_categories(text: str) -> dict[str, str]:
    """Each instruction of a compiled HLO module (``compiled.as_text()``) -> its category (module doc)."""
    dots, comp, parsed = set(), None, []
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            comp = m.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, rest = m.groups()
        op = _OPCODE.search(rest)
        opcode = op.group(1) if op else ""
        if opcode in ("dot", "convolution") or "__cublas" in rest or "__triton_gemm" in rest:
            dots.add(comp)
        parsed.append((name, opcode, rest))
    out = {}
    for name, opcode, rest in parsed:
        op_name = (re.search(r'op_name="([^"]*)"', rest) or [None, ""])[1]
        target = (re.search(r'custom_call_target="([^"]*)"', rest) or [None, ""])[1]
        calls = re.findall(r"calls=%([\w.\-]+)", rest)
        backward = "transpose(" in op_name or "Backward" in target or "bwd" in op_name
        if "fmha" in target:
            out[name] = "attention backward" if "Backward" in target else "attention forward"
        elif target == "__gpu$xla.gpu.triton" and ("flash" in op_name or "attention" in op_name) and (
                "grouped" not in op_name):
            out[name] = "attention backward" if backward else "attention forward"
        elif any(opcode.startswith(c) for c in COLLECTIVES):
            out[name] = "collectives"
        elif opcode in ("copy-start", "copy-done") or "S(5)" in rest.split(opcode + "(")[0]:
            out[name] = "host transfers"
        elif _scope("optimizer", op_name):
            out[name] = "optimizer update"
        elif _scope("loss", op_name):
            out[name] = "tiled loss"
        elif _scope("mlp", op_name):
            out[name] = "MLP chunks"
        elif opcode in ("dot", "convolution") or "__cublas" in target or any(c in dots for c in calls) or (
                target == "__gpu$xla.gpu.triton"):
            out[name] = "GEMMs"
        else:
            out[name] = "elementwise and copies"
    # the kernel of a fusion carries its name with underscores for dots (gemm_fusion_dot.25 -> gemm_fusion_dot_25)
    out.update({k.replace(".", "_"): v for k, v in list(out.items()) if k.replace(".", "_") not in out})
    return out


def kernel_category(kernel: str) -> str:
    """A category from a GPU kernel's own name, for a device op whose ``hlo_op`` is not an instruction of the compiled
    module (the first H100 profile, 2026-11-27, matched none: every op fell to "elementwise and copies").
    cuDNN's attention kernels carry ``sdpa``/``fmha`` and ``fprop``/``bprop``; GEMMs are cuBLAS's (``gemm``,
    ``nvjet``, ``xmma``, CUTLASS) or XLA's Triton GEMM fusions; NCCL's kernels are the collectives."""
    k = kernel.lower()
    if any(t in k for t in ("sdpa", "fmha", "flash_attention", "_mha_", "flash_fprop", "flash_bprop")):
        return "attention backward" if any(t in k for t in ("bprop", "bwd", "backward", "dqdkdv", "dkdv")) else (
            "attention forward")
    if "nccl" in k:
        return "collectives"
    if any(t in k for t in ("gemm", "nvjet", "xmma", "cutlass", "cublas", "wgmma")):
        return "GEMMs"
    if any(t in k for t in ("memcpy htod", "memcpy dtoh", "htod", "dtoh")):
        return "host transfers"
    return "elementwise and copies"


def op_category(categories: dict[str, str], name: str, kind: str) -> str:
    """A traced op's category: host transfers for a memcpy between host and device; else the instruction its
    ``hlo_op`` names; else the instruction whose name its kernel carries (XLA names a fusion's kernel after the
    fusion, dots as underscores: the ops inside a command buffer, whose ``hlo_op`` is the buffer); else by the kernel's
    own name (``kernel_category``)."""
    if kind == "memcpy":
        return "host transfers"
    return categories.get(name) or categories.get(kind) or kernel_category(kind)


def device_events(trace_dir: pathlib.Path) -> list[tuple[float, float, str, str]]:
    """``(start us, end us, hlo_op or event name, kind)`` of the device ops in a perfetto trace: events tagged with
    ``hlo_op`` (kind: the kernel's own name), and memcpy events (kind ``memcpy``)."""
    files = sorted(trace_dir.rglob("*perfetto_trace.json.gz"))
    if not files:
        raise RuntimeError(f"no perfetto trace under {trace_dir}")
    data = json.load(gzip.open(files[-1]))
    events = data["traceEvents"] if isinstance(data, dict) else data
    out = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        args = e.get("args") or {}
        if "hlo_op" in args:
            out.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), args["hlo_op"], e.get("name", "")))
        elif "memcpy" in e.get("name", "").lower():  # device-to-device copies are copies, not host transfers
            out.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"], memcpy_kind(e["name"])))
    return out


def memcpy_kind(name: str) -> str:
    """A memcpy event's kind: ``memcpy`` (a host transfer) between host and device, ``copy`` on the device."""
    return "memcpy" if any(t in name.lower().replace(" ", "") for t in ("htod", "dtoh", "htoh")) else "copy"


def breakdown(events, categories: dict[str, str]) -> tuple[dict[str, float], float]:
    """Seconds per category over the events (overlaps counted once, for the earliest category of ``CATEGORIES``),
    and the span from the first event's start to the last one's end."""
    if not events:
        return {c: 0.0 for c in CATEGORIES}, 0.0
    rank = {c: i for i, c in enumerate(CATEGORIES)}

    points = []
    for start, end, name, kind in events:
        c = rank[op_category(categories, name, kind)]
        points += [(start, 1, c), (end, -1, c)]
    points.sort()
    active = collections.Counter()
    total = {c: 0.0 for c in CATEGORIES}
    last = points[0][0]
    for t, delta, c in points:
        live = [k for k, n in active.items() if n > 0]
        if live and t > last:
            total[CATEGORIES[min(live)]] += (t - last) * 1e-6
        active[c] += delta
        last = t
    return total, (points[-1][0] - points[0][0]) * 1e-6


def plan_lines(plan_json: pathlib.Path, per_step: dict[str, float], idle: float) -> list[str]:
    """``plan``'s estimate parts (a ``plan --json`` file) beside the measured categories (seconds a step), and the
    three largest differences."""
    parts = json.loads(plan_json.read_text())["estimate"]["parts"]
    lines = ["", "| plan's part | estimate ms | measured ms | measured - estimate |", "|---|---|---|---|"]
    diffs = []
    for part, cats in PLAN_PARTS.items():
        est, got = parts.get(part, 0.0), sum(per_step[c] for c in cats)
        diffs.append((abs(got - est), part, est, got))
        lines.append(f"| {part} ({', '.join(cats)}) | {est * 1e3:.1f} | {got * 1e3:.1f} | {(got - est) * 1e3:+.1f} |")
    lines.append(f"| idle gaps (plan: not counted) | 0.0 | {idle * 1e3:.1f} | {idle * 1e3:+.1f} |")
    diffs.append((idle, "idle gaps", 0.0, idle))
    top = sorted(diffs, reverse=True)[:3]
    return lines + ["", "Largest differences: " + "; ".join(f"{p} ({(g - e) * 1e3:+.1f} ms)" for _, p, e, g in top)]


def from_ops(ops_path: pathlib.Path, plan_json: pathlib.Path | None = None) -> pathlib.Path:
    """A stored profile (``*.ops.json.gz`` and the ``*.hlo.txt.gz`` beside it) categorised by this file's rules, as
    ``*.by_category.md`` beside them (module doc); returns its path."""
    stem = pathlib.Path(str(ops_path).removesuffix(".ops.json.gz"))
    hlo, table = pathlib.Path(f"{stem}.hlo.txt.gz"), pathlib.Path(f"{stem}.md")
    if not str(ops_path).endswith(".ops.json.gz") or not ops_path.is_file() or not hlo.is_file():
        raise SystemExit(f"profile_step: --from-ops {ops_path}: give a *.ops.json.gz with its *.hlo.txt.gz beside it")
    categories = hlo_categories(gzip.open(hlo, "rt").read())
    # [hlo_op, kernel, ms a step], largest first; profiles taken before bbdfe5d (2026-11-28) named every memcpy
    # event's kind "memcpy" (MemcpyD2D a host transfer)
    ops = [(name, memcpy_kind(name) if kind == "memcpy" else kind, ms)
           for name, kind, ms in json.load(gzip.open(ops_path, "rt"))]
    per = collections.Counter({c: 0.0 for c in CATEGORIES})
    for name, kind, ms in ops:
        per[op_category(categories, name, kind)] += ms
    total = sum(per.values())
    table_lines = table.read_text().splitlines() if table.is_file() else []
    measured = next((ln for ln in table_lines if ln.startswith("- measured step")), None)
    lines = [f"# {stem.name}: the stored op times by category", "",
             f"- command: `python experiments/profile_step.py --from-ops {ops_path.name}` (no GPU: the op times "
             f"stored by the profile, categorised by the rules of commit `{bench_train_commit()[:7]}`, "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d})",
             f"- the profile's own line: {measured[2:] if measured else '(no table beside it)'}",
             f"- sum of the stored op times: {total:.1f} ms a step ({len(ops):,} ops; overlapping ops count twice)",
             "", "| category | ms per step | share of the sum |", "|---|---|---|"]
    lines += [f"| {c} | {per[c]:.1f} | {per[c] / total:.1%} |" for c in CATEGORIES]
    if plan_json is not None:  # the idle gaps: the profile's step less its busy time (both on its table's line)
        nums = re.findall(r"([\d,.]+) ms", measured or "")
        idle = (float(nums[0].replace(",", "")) - float(nums[1].replace(",", ""))) / 1e3 if len(nums) >= 2 else 0.0
        lines += ["", f"Beside `plan`'s estimate of the same flags (`{plan_json.name}`; an estimate of the program "
                  f"of the commit that wrote it, which may differ from the profiled one):"]
        lines += plan_lines(plan_json, {c: per[c] / 1e3 for c in CATEGORIES}, idle)
    lines += ["", "Largest ops and their category:", "", "| ms per step | category | kernel |", "|---|---|---|"]
    lines += [f"| {ms:.1f} | {op_category(categories, name, kind)} | `{kind[:90]}` |" for name, kind, ms in ops[:30]]
    out = pathlib.Path(f"{stem}.by_category.md")
    out.write_text("\n".join(lines) + "\n")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_ops:
        out = from_ops(args.from_ops, args.plan_json)
        print(out.read_text() + f"wrote {out}")
        return 0
    import os

    if args.allow_cpu:
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    import jax

    import bench_train

    if jax.default_backend() == "cpu" and not args.allow_cpu:
        print("profile_step: no GPU; pass --allow-cpu for a dry run", file=sys.stderr)
        return 2
    if args.quick:
        args.preset, args.seq_lens, args.loss_chunk, args.mlp_chunk, args.warmup = "tiny", [512], 64, 64, 1
    seq_len = args.seq_lens[0]
    step, state, batch, local, cfg, mesh = bench_train.build(args, seq_len)
    # the steps run the executable whose text is categorised: the trace's hlo_op names its instructions
    step = step.lower(state, batch).compile()
    hlo_text = step.as_text()
    categories = hlo_categories(hlo_text)
    for _ in range(args.warmup):
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
    trace_dir = pathlib.Path(tempfile.mkdtemp(prefix="profile_step_"))
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        t0 = time.perf_counter()
        for _ in range(args.profile_steps):
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics["loss"])
        wall = (time.perf_counter() - t0) / args.profile_steps
    events = device_events(trace_dir)
    total, span = breakdown(events, categories)
    matched = sum(e[2] in categories for e in events)
    n = args.profile_steps
    per_step = {c: v / n for c, v in total.items()}
    busy = sum(per_step.values())
    idle = max(wall - busy, 0.0)
    rows = [(c, per_step[c]) for c in CATEGORIES] + [("idle gaps (no device op)", idle)]
    lines = [f"# Where the step goes: {cfg.name}, {seq_len:,} tokens, {jax.devices()[0].device_kind}", "",
             f"- date: `{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC`",
             f"- command: `python experiments/profile_step.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
             f"- commit: `{os.environ.get('ULYSSES_JAX_COMMIT') or bench_train_commit()}`",
             f"- measured step (host, mean of {n} traced steps): {wall * 1e3:.1f} ms; device ops busy "
             f"{busy * 1e3:.1f} ms ({len(events) // max(n, 1):,} ops a step)", "",
             "| category | ms per step | share of the step |", "|---|---|---|"]
    lines += [f"| {c} | {v * 1e3:.1f} | {v / wall:.1%} |" for c, v in rows]
    lines.append(f"| **sum** | {sum(v for _, v in rows) * 1e3:.1f} | {sum(v for _, v in rows) / wall:.1%} |")
    lines += ["", f"{matched:,} of the {len(events):,} device ops traced named an instruction of the compiled module "
              "(categorised by it); the rest by the kernel's own name. Largest device ops (per step; nested ops "
              "counted in each):", "", "| ms per step | category | hlo_op | kernel |", "|---|---|---|---|"]
    by_op = collections.Counter()
    for start, end, name, kind in events:
        by_op[name, kind] += (end - start) * 1e-3 / n
    for (name, kind), ms in by_op.most_common(25):
        cat = op_category(categories, name, kind)
        lines.append(f"| {ms:.1f} | {cat} | `{name[:60]}` | `{kind[:80]}` |")
    by_kernel, launches = collections.Counter(), collections.Counter()
    for start, end, name, kind in events:
        by_kernel[kind] += (end - start) * 1e-3 / n
        launches[kind] += 1 / n
    lines += ["", "The same time by kernel (each kernel's launches a step summed):", "",
              "| ms per step | launches a step | kernel |", "|---|---|---|"]
    lines += [f"| {ms:.1f} | {launches[k]:.0f} | `{k[:100]}` |" for k, ms in by_kernel.most_common(25)]
    if args.plan_json:
        lines += plan_lines(args.plan_json, per_step, idle)
    text = "\n".join(lines) + "\n"
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    kind = jax.devices()[0].device_kind.lower().replace(" ", "-")
    out = args.out_dir / f"profile_{cfg.name}_{seq_len}_{kind}_{datetime.datetime.now():%Y%m%d-%H%M%S}.md"
    out.write_text(text)
    # beside it, for reading after the call: the compiled module and every op's time (hlo_op, kernel, ms a step)
    with gzip.open(out.with_suffix(".hlo.txt.gz"), "wt") as f:
        f.write(hlo_text)
    with gzip.open(out.with_suffix(".ops.json.gz"), "wt") as f:
        json.dump([[name, kind, round(ms, 4)] for (name, kind), ms in by_op.most_common()], f)
    print("wrote", out)
    return 0


def bench_train_commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
