"""Time the real training step (model + Ulysses + FSDP + optimizer) at long context, on whatever devices
are present, and record tokens/s, MFU and peak memory per configuration.

    python experiments/bench_train.py --preset llama3.2-1b --seq-lens 8192,32768,131072 --sp 1
    python experiments/bench_train.py --preset qwen3-4b --seq-lens 32768,65536 --sp 4 --remat full \
        --loss-chunk 4096 --mlp-chunk 4096
    python experiments/bench_train.py --preset llama3.2-1b --seq-lens 8192,32768 --fp8 both   # bf16 and float8 rows
    python experiments/bench_train.py --allow-cpu --quick          # tiny smoke run on fake CPU devices

Batches are random tokens (never zeros), --documents per row (default 1: one document, what a peer without
packing runs; more: cut at random places), labels shifted before the split. Each figure is the median of --steps
timed steps after --warmup steps (the first compiles), each ending in jax.block_until_ready. MFU counts model FLOPs
as ulysses_jax.model.flops does (6 * matmul params * tokens + each document's causal attention; no
rematerialisation; LoRA: the FLOPs performed) against the device's dense bf16 peak (known GPUs) or --peak-tflops. Out-of-memory
and other failures become a row note. ``--fp8``: the projections' GEMMs in float8 (``ModelConfig.fp8``, scales of
``--fp8-recipe``); ``--fp8 both``: each sequence length without and with it, side by side (the MFU of both counts
the same model FLOPs against the bf16 peak). Results: a markdown table and a CSV in --out-dir, headed by date,
hardware, jax version, command line and git commit.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import statistics
import sys
import time

from results_io import run_header, write_table  # beside this script


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3.2-1b")
    p.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768])
    p.add_argument("--batch-size", type=int, default=None, help="rows per step (default: data x fsdp)")
    p.add_argument("--sp", type=int, default=None, help="sequence-parallel degree (default: all devices)")
    p.add_argument("--fsdp", type=int, default=-1)
    p.add_argument("--attention", default="auto")
    p.add_argument("--remat", default="full")
    p.add_argument("--attn-keep", action="store_true", help="keep attention's output: its forward runs once")
    p.add_argument("--mlp-keep", action="store_true",
                   help="keep the MLP's gate and up products too (train's --mlp-keep; with --mlp-chunk 0)")
    p.add_argument("--lora-rank", type=int, default=None,
                   help="train LoRA adapters of this rank (alpha 2 x rank, every projection), the base frozen in bf16")
    p.add_argument("--documents", type=int, default=1, help="documents per row (1: one whole-row document)")
    p.add_argument("--attn-max-documents", type=int, default=0,
                   help="cuDNN's bound on documents a row (train's --attn-max-documents; 0: by the sequence length; "
                        "1: one document, cuDNN's padding mask without the packed layout)")
    p.add_argument("--optim-offload", action="store_true",
                   help="bfloat16 parameters, float32 master weights and AdamW state in host memory (--optim.offload)")
    p.add_argument("--fp8", nargs="?", const="on", default="off", choices=("off", "on", "both"),
                   help="float8 projections (--fp8 of train); both: a row without and one with each")
    p.add_argument("--fp8-recipe", default="current", choices=("current", "delayed"))
    p.add_argument("--delta-precision", default="highest", choices=("highest", "bf16"),
                   help="hybrids: the delta rule's chunk products (train's --delta-precision)")
    p.add_argument("--delta-impl", default="xla", choices=("xla", "pallas"),
                   help="hybrids: the delta rule's walk over chunks (train's --delta-impl)")
    p.add_argument("--scan-unroll", action="store_true", help="the layer loop unrolled (train's --scan-unroll)")
    p.add_argument("--loss-chunk", type=int, default=4096)
    p.add_argument("--mlp-chunk", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    p.add_argument("--allow-cpu", action="store_true", help="run on fake CPU devices (smoke test)")
    p.add_argument("--quick", action="store_true", help="CPU smoke: tiny preset, short rows")
    return p.parse_args(argv)


def random_batch(rows: int, seq_len: int, vocab: int, seed: int = 0, documents: int = 1) -> dict:
    import numpy as np

    from ulysses_jax.data.pipeline import next_token_labels

    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, (rows, seq_len), dtype=np.int32)
    cuts = np.sort(rng.choice(np.arange(1, seq_len), (rows, documents - 1), replace=False), axis=1) if (
        documents > 1) else np.zeros((rows, 0), np.int64)
    seg = (1 + (np.arange(seq_len)[None, :, None] >= cuts[:, None, :]).sum(-1)).astype(np.int32)
    # no "positions": the model derives per-document positions from the segment ids
    return {"tokens": tokens, "segment_ids": seg, "labels": next_token_labels(tokens, seg)}


# ModelConfig fields newer than some packages bench_train runs, with the values that leave them off: the baseline of a
# before/after (first_contact.sh) runs an earlier commit's package, which may lack them
LATER_FIELDS = {"mlp_keep": False, "delta_precision": "highest", "delta_impl": "xla", "attn_max_documents": 0,
                "scan_unroll": False}


def known_fields(config_cls, values: dict) -> dict:
    """``values`` that ``config_cls`` has a field for; one it lacks is dropped when off, refused in one line if set."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    for name, value in values.items():
        if name not in fields and value != LATER_FIELDS.get(name):
            raise SystemExit(f"bench_train.py: this package's {config_cls.__name__} has no {name} (given {value!r}); "
                             f"drop its flag or run a package that has it")
    return {name: value for name, value in values.items() if name in fields}


def build(args, seq_len: int):
    """``(step, state, batch, local rows, cfg, mesh)``: the real training step of ``args``' model and flags at
    ``seq_len``, its state born sharded and one random batch (``random_batch``) on the mesh."""
    import jax

    from ulysses_jax.data.pipeline import to_global
    from ulysses_jax.model.config import ModelConfig
    from ulysses_jax.model.lora_config import LoraConfig, default_targets
    from ulysses_jax.parallel.mesh import make_mesh
    from ulysses_jax.train.devices import check_parallel
    from ulysses_jax.train.step import (
        OptimConfig,
        init_state,
        make_optimizer,
        make_schedule,
        make_train_step,
        state_shardings,
    )

    n = jax.device_count()
    sp = args.sp or n
    mesh = make_mesh(fsdp=args.fsdp, sp=sp)
    rows = args.batch_size or mesh.shape["data"] * mesh.shape["fsdp"]
    later = {name: getattr(args, name, off) for name, off in LATER_FIELDS.items()}
    cfg = ModelConfig.from_preset(args.preset, attention_impl=args.attention, remat=args.remat,
                                  attn_keep=args.attn_keep, loss_chunk=args.loss_chunk, mlp_chunk=args.mlp_chunk,
                                  **known_fields(ModelConfig, later))
    if getattr(args, "fp8", "off") != "off":  # main() runs "both" as an "off" and an "on" row
        cfg = dataclasses.replace(cfg, fp8=True, fp8_recipe=getattr(args, "fp8_recipe", "current"))
    if args.lora_rank:
        cfg = dataclasses.replace(cfg, lora=LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank,
                                                       targets=default_targets(cfg)), param_dtype="bfloat16")
    optim = OptimConfig(offload=True, master_weights=True) if args.optim_offload else OptimConfig()
    if args.optim_offload:
        cfg = dataclasses.replace(cfg, param_dtype="bfloat16")
    check_parallel(cfg, mesh, seq_len=seq_len, batch_size=rows)
    tx = make_optimizer(optim.resolved(1000, lora=bool(args.lora_rank)), 1000)
    graphdef, state = init_state(cfg, mesh, tx, seed=0)
    step = make_train_step(graphdef, tx, make_schedule(optim, 1000), mesh, state_shardings(state))
    local = random_batch(rows, seq_len, cfg.vocab_size, documents=args.documents)
    return step, state, to_global(local, mesh), local, cfg, mesh


def bench_one(args, seq_len: int) -> dict:
    import jax

    from ulysses_jax.model import flops
    from ulysses_jax.train.metrics import peak_memory_bytes

    step, state, batch, local, cfg, mesh = build(args, seq_len)
    rows, n = local["tokens"].shape[0], mesh.devices.size
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    per_device = flops.batch_flops_per_device(cfg, local["segment_ids"], global_batch=rows, n_devices=n)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else flops.peak_flops(jax.devices()[0].device_kind)
    mem = peak_memory_bytes()
    return {
        "seq_len": seq_len, "rows": rows, "mesh": "x".join(f"{k}{v}" for k, v in mesh.shape.items()),
        "step_s": f"{dt:.3f}", "tokens_per_s": f"{rows * seq_len / dt:,.0f}",
        "tflops_per_device": f"{per_device / dt / 1e12:.1f}",
        "mfu": f"{100 * per_device / dt / peak:.1f}%" if peak else "",
        "peak_mem_gib": f"{mem / 2**30:.1f}" if mem else "", "loss": f"{float(metrics['loss']):.3f}", "note": "",
        "fp8": f"on ({cfg.fp8_recipe})" if cfg.fp8 else "off",
    }


def header(args) -> dict:
    lora = f", LoRA rank {args.lora_rank} (MFU counts the FLOPs performed: no frozen weight's gradient)" if (
        args.lora_rank) else ""
    return run_header(model=f"{args.preset}, attention {args.attention}, remat {args.remat}"
                            f"{' + attn-keep' if args.attn_keep else ''}"
                            f"{' + mlp-keep' if getattr(args, 'mlp_keep', False) else ''}{lora}, "
                            f"{args.documents} document(s) "
                            f"per row (MFU: causal attention per document), "
                            f"loss_chunk {args.loss_chunk}, mlp_chunk {args.mlp_chunk}"
                            f"{', layer loop unrolled' if getattr(args, 'scan_unroll', False) else ''}"
                            f"{'' if args.fp8 == 'off' else f', --fp8 {args.fp8} (recipe {args.fp8_recipe})'}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.allow_cpu:
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax

    if jax.default_backend() == "cpu" and not args.allow_cpu:
        print("bench_train: no GPU (jax.default_backend() == 'cpu'); pass --allow-cpu for a smoke run", file=sys.stderr)
        return 2
    if args.quick:
        args.preset, args.seq_lens, args.loss_chunk, args.mlp_chunk, args.steps, args.warmup = (
            "tiny", [512, 1024], 64, 64, 2, 1)
    rows = []
    for s in args.seq_lens:
        for mode in ("off", "on") if args.fp8 == "both" else (args.fp8,):
            try:
                row = bench_one(argparse.Namespace(**{**vars(args), "fp8": mode}), s)
            except Exception as e:  # noqa: BLE001 - OOM or unsupported: a row note, not a crash
                row = {"seq_len": s, "fp8": mode, "note": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
            print(row, flush=True)
            rows.append(row)
    meta = header(args)
    cols = ["seq_len", "fp8", "rows", "mesh", "step_s", "tokens_per_s", "tflops_per_device", "mfu", "peak_mem_gib",
            "loss", "note"]
    kind = jax.devices()[0].device_kind.lower().replace(" ", "-")
    lora = (f"_lora{args.lora_rank}" if args.lora_rank else "") + ("" if args.fp8 == "off" else f"_fp8{args.fp8}")
    stem = args.out_dir / f"train_{args.preset}{lora}_{kind}_{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    print("wrote", *write_table(stem, "Training-step benchmark", meta, cols, rows))
    if not any(r.get("step_s") for r in rows):  # a note per row is kept, but a run that timed nothing fails
        print(f"bench_train: no row ran ({rows[0]['note']}); see the table's notes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
