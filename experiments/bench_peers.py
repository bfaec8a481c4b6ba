"""Our training step beside the peer's, on the same GPU in one invocation: same model shapes, same tokens, one document
per row or packed rows; the step times, their ratio, the peaks, and `plan`'s estimate for our flags, in one CSV and its
table.

    python experiments/bench_peers.py                                  # every row (minutes per row on one GPU)
    python experiments/bench_peers.py --rows 1b-32k,8b-lora-32k        # a selection (names: --list)
    python experiments/bench_peers.py --allow-cpu --quick              # CPU dry run: tiny shapes, every code path
    python experiments/bench_peers.py --fill-estimates CSV --target h200   # on a CPU machine: plan's estimates

Each measurement runs in a child process of its own (`--child`), so neither framework's memory pool sees the other's
and each peak is the measured one's alone; a child that runs out of memory or fails leaves its time empty and says
why in the table's `note` column (the .md; the CSV keeps the issue's columns). Ours gets a memory pool of 95% of the
GPU, as `train` does (JAX's own default is 75%); the peer's PyTorch allocator takes what it needs. The first of our
flag sets runs first, then the peers, then the rest of ours, and both files are rewritten after each measurement:
a call stopped at its time limit (`--deadline`: no child starts past it, each ends before it) keeps a comparison.
Ours: `experiments/bench_train.py`'s step (the real training step: model, loss, AdamW) with the row's
flags. The peers (`peer_step.py`, imported by their child only), in the way a user would pick them:
- `transformers`: `AutoModelForCausalLM.from_config` of the same shapes, SDPA attention, gradient checkpointing,
  float32 weights under bfloat16 autocast, the global gradient norm clipped at 1 (as ours and the Trainer clip),
  `torch.optim.AdamW(fused=True)`; LoRA: a bfloat16 base and `peft.get_peft_model` with r 16, alpha 32 on the seven
  projections, its float32 adapters under the same autocast (ours: the same adapters, `--lora-rank 16`; through
  2026-11-28 the LoRA peer ran without autocast and no clipping: its adapters' GEMMs in float32, work ours does not do);
- `transformers+liger`: the same after `liger_kernel.transformers.apply_liger_kernel_to_<family>()` (fused linear
  cross-entropy, RMSNorm, SwiGLU, RoPE), when `liger-kernel` imports (a GPU with Triton; carried as a wheel);
- either with `/no-checkpointing` (`--peers transformers+liger/no-checkpointing`): the same without gradient
  checkpointing, the peer's fastest step where its activations fit (ours keeps products too, `SAVE`, where they fit:
  a ratio against the checkpointing peer alone would credit ours with a recompute the peer need not run).
Ours on rows of one document takes `--attn-max-documents 1` unless the flag set gives it (cuDNN's causal mask alone,
no packed workspace zeroed each layer: 32 ms of the 8B LoRA 8K step on the H200 of 2026-11-28), as the flags column
then says; the peer's SDPA takes such a row with its causal mask alone too.
Packed rows (`documents` > 1, the `-packed4` rows: 4 documents of random lengths in each row, the same cuts for both):
ours takes the segment ids (cuDNN's packed attention); the peer takes position ids that restart at each document, from
which transformers builds a per-document causal mask, with `flex_attention` (block-sparse; SDPA would get a dense
`[S, S]` mask and lose its flash kernels; the CPU dry run takes it, flex attention having no backward on a CPU); if
flex attention fails on the image, the note says so. `plan`'s estimate
counts one document a row, so packed rows leave `estimate_s` empty.
Both step times are the median of --steps timed steps after --warmup; `speedup` = peer / ours. `estimate_s` is
`ulysses-jax plan`'s estimate for our flags on one compile-only GPU of the matching kind; a GPU run leaves it empty
and `--fill-estimates` fills it on any machine with the aot extra (compiling takes minutes, not GPU time).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from peer_step import NO_CHECKPOINTING  # noqa: E402 - peer_step imports torch and the rest in its function only

COLUMNS = ["model", "mode", "seq_len", "documents", "flags", "peer", "ours_step_s", "peer_step_s", "speedup",
           "estimate_s", "ours_peak_gib", "peer_peak_gib", "gpu", "date", "commit"]
BASE = "--remat full --loss-chunk 4096 --mlp-chunk 4096"
XLA = "XLA:"  # a flag-set token XLA:<flag> goes to our child's XLA_FLAGS, not to bench_train
NO_TRITON = XLA + "--xla_gpu_enable_triton_gemm=false"
HOST_OPTIM = "--remat full --loss-chunk 4096 --mlp-chunk 4096 --optim-offload"


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    preset: str
    mode: str  # "full" or "lora16"
    seq_len: int
    flag_sets: tuple[str, ...]  # our flags (train's names; XLA:<flag> one of XLA's), one timing each
    documents: int = 1  # per row (> 1: packed; the peer on flex attention with per-document position ids)


KEEP = BASE + " --attn-keep"
# the matmul outputs kept as well (the MLP untiled, so its GEMMs' outputs are kept too): the backward re-runs the
# elementwise work (norms, RoPE, SiLU) and the tiled loss; plan: 54.5 GiB and 0.93 s on an H100 (KEEP: 1.00 s)
SAVE = "--remat save_matmuls --attn-keep --loss-chunk 4096 --mlp-chunk 0"
# between the two: the MLP's gate and up products kept as well (its GEMMs run once), the attention's projections run
# again; for an 8B model at 32K on one H200 the one that fits without XLA re-running GEMMs itself (plan: 93.6 GiB,
# an estimated 4.16 s against KEEP's 4.64; SAVE 113.7 GiB, 4.60)
KEEP_MLP = "--remat full --attn-keep --mlp-keep --loss-chunk 4096 --mlp-chunk 0"
ROWS = (  # the float8 rows (--fp8, issue 40) time float8 against bf16 in the same call too
    Row("1b-8k", "llama3.2-1b", "full", 8192, (BASE, KEEP, KEEP + " --fp8")),
    Row("1b-32k", "llama3.2-1b", "full", 32768, (BASE, KEEP, SAVE, KEEP + " --fp8")),
    Row("1b-128k", "llama3.2-1b", "full", 131072, (KEEP, KEEP_MLP)),
    Row("1b-32k-packed4", "llama3.2-1b", "full", 32768, (KEEP, SAVE), documents=4),
    # XLA's GEMMs without Triton: its float8 dots then become cuBLASLt's float8 GEMMs (compile-only H100, runtime 13.0)
    # SAVE: LoRA's save_matmuls keeps the base products only since the adapters' full-width terms are recomputed
    # (plan on an H200: 41.7 GiB, an estimated 0.63 s against KEEP's 0.80)
    Row("8b-lora-8k", "llama3.1-8b", "lora16", 8192, (KEEP, SAVE, KEEP + " --fp8", SAVE + " --fp8",
                                                      KEEP + " --fp8 " + NO_TRITON)),
    Row("8b-lora-32k", "llama3.1-8b", "lora16", 32768, (KEEP, KEEP_MLP, KEEP + " --fp8", KEEP_MLP + " --fp8")),
    Row("8b-lora-64k", "llama3.1-8b", "lora16", 65536, (KEEP,)),
    Row("8b-lora-32k-packed4", "llama3.1-8b", "lora16", 32768, (KEEP,), documents=4),
    # plan counts 91.5 GiB of pinned host memory on a compile-only H200 (169 GiB before the state was kept by layer),
    # within the lent machine's 128 GiB: call K (experiments/results/plan_qwen3_8b_32k_h200_host_optimizer.md)
    Row("qwen3-8b-32k", "qwen3-8b", "full", 32768, (HOST_OPTIM,)),
    # issue 39: a hybrid (gated delta-net layers) beside transformers' Qwen3_5ForCausalLM, whose delta rule is
    # flash-linear-attention's kernel where fla imports and its own torch loop where not (the note says which)
    Row("qwen3.5-9b-lora-8k", "qwen3.5-9b", "lora16", 8192, (KEEP, KEEP + " --delta-precision bf16",
                                                              KEEP + " --delta-impl pallas",
                                                              KEEP + " --delta-impl pallas --delta-precision bf16")),
    Row("qwen3.5-9b-lora-32k", "qwen3.5-9b", "lora16", 32768, (KEEP, KEEP + " --delta-precision bf16")),
    # the small hybrid (the Hub's Qwen3.5-0.8B shapes), full fine-tuning: a peer that finishes its steps in a call
    # (transformers' torch loop over 64-token chunks did not finish 3 steps of the 9B's LoRA at 8K in 100 s)
    Row("qwen3.5-0.8b-8k", "qwen3.5-0.8b", "full", 8192, (KEEP, KEEP + " --delta-impl pallas")),
    Row("qwen3.5-0.8b-32k", "qwen3.5-0.8b", "full", 32768, (KEEP, KEEP + " --delta-impl pallas",
                                                          KEEP + " --delta-impl pallas --delta-precision bf16")),
)
QUICK = (Row("quick", "tiny", "full", 512, ("--remat full --loss-chunk 64 --mlp-chunk 64",
                                            "--remat full --loss-chunk 64 --mlp-chunk 64 --attn-keep")),
         Row("quick-lora", "tiny", "lora16", 512, ("--remat full --loss-chunk 64 --mlp-chunk 64",)),
         Row("quick-hybrid", "tiny-hybrid", "lora16", 512, ("--remat full --loss-chunk 64 --mlp-chunk 64",)),
         Row("quick-packed", "tiny", "full", 512, ("--remat full --loss-chunk 64 --mlp-chunk 64",), documents=4))
PEERS = ("transformers", "transformers+liger")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=None, help="comma-separated row names (default: all; --list shows them)")
    p.add_argument("--list", action="store_true")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--flag-sets", default=None, help='our flag sets for every chosen row instead of its own, split by '
                   '"|" (KEEP, SAVE, BASE stand for the module\'s sets: "SAVE|SAVE --fp8")')
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=int, default=600, help="seconds for each child measurement")
    p.add_argument("--peer-profile", action="store_true",
                   help="one more peer step under torch's profiler: its attention kernels and their time in the note")
    p.add_argument("--deadline", type=int, default=None,
                   help="seconds for the whole invocation: each child's timeout is cut to what is left (the GPU "
                        "scripts give their step's limit less a margin)")
    p.add_argument("--out-dir", type=pathlib.Path, default=HERE / "results")
    p.add_argument("--allow-cpu", action="store_true", help="run on the CPU (a dry run; times mean nothing)")
    p.add_argument("--quick", action="store_true", help="the tiny rows (with --allow-cpu: the CI dry run)")
    p.add_argument("--fill-estimates", type=pathlib.Path, default=None, help="a CSV of this script: fill estimate_s")
    p.add_argument("--target", default=None, help="with --fill-estimates: h100 or h200 (default: from the gpu column)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # JSON of one measurement (internal)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------ children


def split_flags(flags: str) -> tuple[list[str], list[str]]:
    """A flag set's ``(our arguments, XLA flags)``: tokens ``XLA:<flag>`` are XLA's."""
    tokens = flags.split()
    return [t for t in tokens if not t.startswith(XLA)], [t[len(XLA):] for t in tokens if t.startswith(XLA)]


def ours(spec: dict) -> dict:
    """Our step: bench_train's, one document per row, on one device."""
    import bench_train

    argv = ["--preset", spec["preset"], "--seq-lens", str(spec["seq_len"]), "--sp", "1", "--fsdp", "1",
            "--batch-size", "1", "--documents", str(spec["documents"]), "--steps", str(spec["steps"]),
            "--warmup", str(spec["warmup"]), *split_flags(spec["flags"])[0]]
    if spec["mode"] == "lora16":
        argv += ["--lora-rank", "16"]
    if spec.get("allow_cpu"):
        argv += ["--allow-cpu"]
    args = bench_train.parse_args(argv)
    row = bench_train.bench_one(args, spec["seq_len"])
    return {"step_s": float(row["step_s"]), "peak_gib": float(row["peak_mem_gib"]) if row["peak_mem_gib"] else None,
            "loss": float(row["loss"])}


def child_main(spec: dict) -> int:
    try:
        if spec["who"] == "ours":
            result = ours(spec)
        else:
            from peer_step import peer  # torch, transformers, peft and liger: imported in the peer's child only

            result = peer(spec)
    except Exception as e:  # noqa: BLE001 - reported as the row's note
        text = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        oom = "out of memory" in str(e).lower() or "RESOURCE_EXHAUSTED" in str(e) or "OutOfMemory" in text
        result = {"error": ("out of memory: " if oom else "") + text[:200]}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def measure(spec: dict, timeout: int) -> dict:
    """One child measurement (``--child``); its RESULT line, or the reason there is none."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"} if spec["who"] == "peer" else (
        {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95", **os.environ})  # train's pool, not JAX's 75%
    env.pop("XLA_FLAGS", None)  # one device: the peer has one
    xla = split_flags(spec["flags"])[1] if spec["who"] == "ours" else []
    if xla:
        env["XLA_FLAGS"] = " ".join(xla)
    if spec.get("allow_cpu"):
        env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout} s"}
    wall = {"wall_s": round(time.perf_counter() - t0, 1)}  # the child's whole time (start, compile, steps)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return {**json.loads(line[len("RESULT "):]), **wall}
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
    return {"error": f"exit {proc.returncode}: {tail[0][:200]}", **wall}


# ------------------------------------------------------------------------------------------------ the table


def _gib(x):
    return "" if x is None else f"{x:.1f}"


NOT_YET = {"error": "not measured: the call's time limit came first"}


def rows_for(row: Row, peers: list[str], args, gpu: str, commit: str, save=lambda rows: None) -> list[dict]:
    """The row's CSV lines, one per flag set of ours and peer. Our first flag set runs first, then each peer, then
    the rest of ours; after each measurement ``save`` gets the lines so far (a peer not measured yet: an empty time
    and a note), so a run stopped at its time limit (a slow or hanging peer: transformers' Qwen3.5 on the H200 of
    2026-11-28) keeps a comparison."""
    common = dict(preset=row.preset, mode=row.mode, seq_len=row.seq_len, documents=row.documents, steps=args.steps,
                  warmup=args.warmup, allow_cpu=args.allow_cpu, profile=getattr(args, "peer_profile", False))
    mines, theirs = {}, {}
    order = [("ours", row.flag_sets[0]), *(("peer", p) for p in peers), *(("ours", f) for f in row.flag_sets[1:])]
    for who, what in order:
        spec = {**common, "who": who, **({"flags": what} if who == "ours" else {"peer": what})}
        left = args.timeout if args.ends_at is None else min(args.timeout, int(args.ends_at - time.monotonic()) - 5)
        result = measure(spec, left) if left >= 10 else {"error": "not run: --deadline reached"}
        (mines if who == "ours" else theirs)[what] = result
        print(json.dumps({"row": row.name, who: what, **result}), flush=True)
        save(out := _lines(row, mines, theirs, peers, gpu, commit))
    for line in out:
        print(json.dumps(line), flush=True)
    return out


def _lines(row: Row, mines: dict, theirs: dict, peers: list[str], gpu: str, commit: str) -> list[dict]:
    out = []
    for flags, mine in mines.items():
        for p in peers:
            t = theirs.get(p, NOT_YET)
            ours_s, peer_s = mine.get("step_s"), t.get("step_s")
            notes = [f"ours: {mine['error']}" if "error" in mine else "",
                     f"{p}: {t['error']}" if "error" in t else "", t.get("kernel", ""), t.get("attention", "")]
            out.append({
                "model": row.preset, "mode": row.mode, "seq_len": row.seq_len, "documents": row.documents,
                "flags": flags,
                "peer": p, "ours_step_s": "" if ours_s is None else f"{ours_s:.3f}",
                "peer_step_s": "" if peer_s is None else f"{peer_s:.3f}",
                "speedup": f"{peer_s / ours_s:.2f}" if ours_s and peer_s else "", "estimate_s": "",
                "ours_peak_gib": _gib(mine.get("peak_gib")), "peer_peak_gib": _gib(t.get("peak_gib")), "gpu": gpu,
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "commit": commit,
                "note": "; ".join(n for n in notes if n)})
    return out


def write(stem: pathlib.Path, rows: list[dict], header: list[str]) -> list[pathlib.Path]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    cols = COLUMNS[:12] + ["note"]
    lines = ["# Our training step beside the peer's, same GPU, same call", ""] + [f"- {h}" for h in header] + [""]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return [stem.with_suffix(".csv"), stem.with_suffix(".md")]


def plan_of_row(r: dict, kind: str):
    """``plan`` (no detail) of a CSV row's configuration on one compile-only GPU of ``kind`` (h100 / h200)."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # the CUDA plugin registers without a GPU
    from ulysses_jax.cli import parse
    from ulysses_jax.plan.planner import plan

    flags = split_flags(r["flags"].replace("--optim-offload", "--optim.offload --optim.master-weights --param-dtype "
                                                        "bfloat16"))[0]  # XLA flags: the estimate ignores them
    lora = ["--lora-rank", "16"] if r["mode"] == "lora16" else []
    cfg = parse(["plan", "--preset", r["model"], "--seq-len", str(r["seq_len"]), "--batch-size", "1", "--devices",
                 "1", "--mesh.fsdp", "1", "--mesh.sp", "1", "--target", kind, "--no-kernels", *lora, *flags])
    return plan(cfg, detail=False)


def gpu_kind(gpu: str) -> str:
    return "h200" if "h200" in gpu.lower() else "h100"


def fill_estimates(path: pathlib.Path, target: str | None) -> int:
    """``estimate_s`` of every row: ``plan`` for our flags on one compile-only GPU (h100 / h200 by the gpu column)."""
    rows = list(csv.DictReader(open(path)))
    cache = {}
    for r in rows:
        if int(r.get("documents") or 1) > 1:  # plan counts one document a row: no estimate for packed rows
            continue
        kind = target or gpu_kind(r["gpu"])
        key = (r["model"], r["mode"], r["seq_len"], r["flags"], kind)
        if key not in cache:
            p = plan_of_row(r, kind)
            cache[key] = "" if p.estimate is None else f"{p.estimate['step_seconds']:.3f}"
            print(f"{key}: estimate {cache[key]} s", flush=True)
        r["estimate_s"] = cache[key]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS + [c for c in rows[0] if c not in COLUMNS] if rows else COLUMNS)
        w.writeheader()
        w.writerows(rows)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(json.loads(args.child))
    if args.fill_estimates:
        return fill_estimates(args.fill_estimates, args.target)
    table = QUICK if args.quick else ROWS
    if args.list:
        for r in table:
            docs = f", {r.documents} documents a row" if r.documents > 1 else ""
            print(f"{r.name}: {r.preset} {r.mode} {r.seq_len:,} tokens{docs}; ours: {' | '.join(r.flag_sets)}")
        return 0
    chosen = [r for r in table if args.rows is None or r.name in args.rows.split(",")]
    if args.flag_sets:
        chosen = [dataclasses.replace(r, flag_sets=flag_sets(args.flag_sets)) for r in chosen]
    if args.quick:  # a dry run of a GPU call's flag sets: their chunks cut to the tiny rows' 512 tokens
        chosen = [dataclasses.replace(r, flag_sets=tuple(map(quick_chunks, r.flag_sets))) for r in chosen]
    chosen = [dataclasses.replace(r, flag_sets=tuple(one_document(f, r.documents) for f in r.flag_sets))
              for r in chosen]
    unknown = set(args.rows.split(",")) - {r.name for r in table} if args.rows else set()
    if unknown or not chosen:
        print(f"bench_peers: unknown rows {sorted(unknown)}; choose from {', '.join(r.name for r in table)}",
              file=sys.stderr)
        return 2
    gpu = _gpu_name()
    if gpu is None and not args.allow_cpu:
        print("bench_peers: no GPU (nvidia-smi found none); pass --allow-cpu for a dry run", file=sys.stderr)
        return 2
    gpu = gpu or "cpu"
    commit = os.environ.get("ULYSSES_JAX_COMMIT") or _git("rev-parse", "HEAD")
    peers = [p for p in args.peers.split(",") if p]
    bad = [p for p in peers if not known_peer(p)]
    if bad:
        print(f"bench_peers: unknown peer {bad[0]!r}; choose from {', '.join(PEERS)}, each optionally with "
              f"/{NO_CHECKPOINTING}", file=sys.stderr)
        return 2
    stamp = datetime.datetime.now(datetime.timezone.utc)
    kind = gpu.lower().replace("nvidia ", "").split()[0] if gpu != "cpu" else "cpu"
    header = [f"date: `{stamp:%Y-%m-%d %H:%M} UTC`", f"gpu: `{gpu}`", f"commit: `{commit}`",
              f"command: `python experiments/bench_peers.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
              "batch 1, one device, one document a row (`documents` > 1: packed rows, the same cuts for both); step "
              "times: median of the timed steps; speedup = peer / ours",
              "peaks: ours jax's peak_bytes_in_use, the peer's torch.cuda.max_memory_allocated",
              "recompute: a peer checkpoints every layer (its forward runs twice) unless named /no-checkpointing; "
              "ours re-runs what its --remat flags say (`--remat full`: the layer, `--attn-keep` its attention "
              "forward kept; `save_matmuls`: elementwise work only): the like-for-like pairs are `--remat full` with "
              "a checkpointing peer and `save_matmuls` with /no-checkpointing"]
    stem, rows = args.out_dir / f"peers_{kind}_{stamp:%Y%m%d-%H%M}", []
    args.ends_at = None if args.deadline is None else time.monotonic() + args.deadline
    for row in chosen:  # the files rewritten after each measurement: a run stopped at its limit keeps what it measured
        rows += rows_for(row, peers, args, gpu, commit, save=lambda part: write(stem, rows + part, header))
    print("wrote", *write(stem, rows, header))
    return 0


def one_document(flags: str, documents: int) -> str:
    """``flags`` with ``--attn-max-documents 1`` added on rows of one document, unless they give it (module doc)."""
    return flags if documents != 1 or "--attn-max-documents" in flags else f"{flags} --attn-max-documents 1"


def known_peer(name: str) -> bool:
    """Whether ``name`` is one of ``PEERS``, optionally with ``/no-checkpointing`` (peer_step's variant)."""
    base, _, variant = name.partition("/")
    return base in PEERS and variant in ("", NO_CHECKPOINTING)


def quick_chunks(flags: str) -> str:
    """``flags`` with each nonzero ``--loss-chunk`` / ``--mlp-chunk`` set to 64, which divides the tiny rows."""
    return re.sub(r"(--(?:loss|mlp)-chunk) ([1-9][0-9]*)", r"\1 64", flags)


def flag_sets(text: str) -> tuple[str, ...]:
    """``--flag-sets``' sets, each a set of flags whose first token may name one of the module's sets (BASE, KEEP,
    SAVE, KEEP_MLP, HOST_OPTIM, NO_TRITON), expanded."""
    named = {"BASE": BASE, "KEEP": KEEP, "SAVE": SAVE, "KEEP_MLP": KEEP_MLP, "HOST_OPTIM": HOST_OPTIM,
             "NO_TRITON": NO_TRITON}
    return tuple(" ".join(named.get(t, t) for t in part.split()) for part in text.split("|") if part.strip())


def _gpu_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = out.stdout.strip().splitlines()
    return names[0] if out.returncode == 0 and names else None


def _git(*args) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=HERE).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
