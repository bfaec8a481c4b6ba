"""Time attention implementations side by side on one GPU: ours (Pallas flash attention), cuDNN, XLA,
and JAX's own Pallas (Triton) attention op.

    python experiments/bench_attention.py                  # S in 4K..128K, D in {64, 128}, bf16
    python experiments/bench_attention.py --quick          # S in {4K, 8K}, D = 128
    python experiments/bench_attention.py --allow-cpu --quick   # tiny smoke run on CPU (interpret mode)

Workload: bf16, B * S = --tokens (default 32K tokens, B >= 1), H = Hkv = --heads (default 16), layout
[B, S, H, D]; masks: causal, full, and packed (causal with 8 documents of random lengths per row, segment ids: ours,
XLA, and cuDNN's packed layout). FLOPs: forward 4*B*H*S^2*D (halved when causal or packed: packed rows count one
causal document, the work of a kernel that skips no cross-document tile); backward 2.5x forward, its time the
forward+backward time less the forward's. Beside ours, the static estimate (``ulysses_jax/kernels/flash_estimate.py``,
best / no overlap, an estimate) and, at D=128, FlashAttention-3's published H100 figures at S=16K.
Each number is the median of --iters timed calls after --warmup calls, each call ending in
jax.block_until_ready. "% peak" is relative to an 8192^3 bf16 matmul timed in the same run;
"vs cuDNN" is cuDNN's time over this implementation's time (> 1: faster than cuDNN). "max |diff|" is
the forward output's largest absolute difference to cuDNN's (or to XLA's where cuDNN failed).
Failures (out of memory, unsupported) become a row note. Results: a markdown table, a CSV and a plot
in --out-dir, headed by date, device, jax version, command line and git commit.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
from results_io import run_header, write_table  # noqa: E402  (beside this script)

from ulysses_jax.kernels.flash_attention import flash_attention  # noqa: E402

IMPLS = ("ours", "cudnn", "xla", "pallas_mha")
MASKS = ("causal", "full", "packed")
# FlashAttention-3 (arXiv 2407.08608), H100 SXM5, bf16, head_dim 128, S = 16K: (mask, direction) -> TFLOP/s
FA3_PUBLISHED = {("full", "fwd"): 648, ("causal", "fwd"): 616, ("causal", "bwd"): 561}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="comma-separated sequence lengths (default 4096,...,131072)")
    p.add_argument("--head-dims", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="comma-separated head dims (default 64,128)")
    p.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    p.add_argument("--quick", action="store_true", help="fewer shapes and timed runs")
    p.add_argument("--allow-cpu", action="store_true", help="run a tiny configuration on CPU (smoke test)")
    p.add_argument("--tokens", type=int, default=None, help="B * S (default 32768)")
    p.add_argument("--heads", type=int, default=None, help="query = kv heads (default 16)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 20)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLS), help=",".join(IMPLS))
    args = p.parse_args(argv)
    cpu = jax.default_backend() == "cpu"
    if cpu:  # tiny shapes: the Pallas kernels run in interpret mode
        defaults = dict(seq_lens=[128], head_dims=[32], tokens=256, heads=2, iters=3)
    elif args.quick:
        defaults = dict(seq_lens=[4096, 8192], head_dims=[128], tokens=32768, heads=16, iters=10)
    else:
        defaults = dict(seq_lens=[4096, 8192, 16384, 32768, 65536, 131072], head_dims=[64, 128], tokens=32768, heads=16,
                        iters=20)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def median_seconds(fn, *args, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_size() -> int:
    return 256 if jax.default_backend() == "cpu" else 8192


def matmul_peak_tflops(n: int, args) -> float:
    a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16) for i in (1, 2))
    t = median_seconds(jax.jit(jnp.matmul), a, b, warmup=args.warmup, iters=args.iters)
    return 2 * n**3 / t / 1e12


def attention_fn(impl: str, causal: bool, d: int, cpu: bool, segment_ids=None):
    """(q, k, v) -> out, in [B, S, H, D]."""
    if impl == "ours":
        return lambda q, k, v: flash_attention(q, k, v, causal=causal, segment_ids=segment_ids)
    if impl == "cudnn" and segment_ids is not None:  # packed rows: cuDNN's ragged layout (kernels/cudnn_packed.py)
        from ulysses_jax.kernels.attention import attention

        return lambda q, k, v: attention(q, k, v, causal=causal, segment_ids=segment_ids, impl="cudnn", platform="gpu")
    if segment_ids is not None and impl != "xla":
        raise ValueError(f"{impl} takes no segment ids")
    if impl == "xla" and segment_ids is not None:
        from ulysses_jax.kernels.attention import xla_attention

        return lambda q, k, v: xla_attention(q, k, v, causal=causal, segment_ids=segment_ids, scale=1 / math.sqrt(d))
    if impl in ("cudnn", "xla"):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
    if impl == "pallas_mha":
        # jax.experimental.pallas.ops.gpu.attention.mha: [B, S, H, D] too, MHA only, sm_scale defaults to 1.
        from jax.experimental.pallas.ops.gpu import attention as jax_pallas_attention

        return lambda q, k, v: jax_pallas_attention.mha(q, k, v, None, sm_scale=1 / math.sqrt(d), causal=causal,
                                                        interpret=cpu)
    raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS}")


def fwd_bwd(attn):
    def step(q, k, v, do):
        out, vjp = jax.vjp(attn, q, k, v)
        return vjp(do)

    return step


def device_bytes() -> int | None:
    try:
        return jax.devices()[0].memory_stats()["bytes_limit"]
    except Exception:  # CPU has no memory_stats
        return None


def short_error(e: Exception) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text[:120] + ("..." if len(text) > 120 else "")


def run(args):
    cpu = jax.default_backend() == "cpu"
    peak = matmul_peak_tflops(matmul_size(), args)
    print(f"bf16 matmul peak ({matmul_size()}^3): {peak:.3g} TFLOP/s")
    rows = []
    for s in args.seq_lens:
        b = max(1, args.tokens // s)
        h = args.heads
        for d in args.head_dims:
            keys = jax.random.split(jax.random.key(s * 1000 + d), 4)
            q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in keys)
            for mask in MASKS:
                causal = mask != "full"
                seg = packed_segment_ids(b, s, seed=s + d) if mask == "packed" else None
                fwd_flops = 4 * b * h * s * s * d / (2 if causal else 1)
                outputs, fwd_ms = {}, {}
                for direction, flops in (("fwd", fwd_flops), ("fwd+bwd", 3.5 * fwd_flops)):
                    for impl in args.impls:
                        row = dict(impl=impl, seq_len=s, head_dim=d, mask=mask, direction=direction, batch=b,
                                   heads=h, ms="", tflops="", pct_peak="", vs_cudnn="", max_abs_diff="",
                                   estimate_tflops=estimate(impl, d, mask, direction, s),
                                   fa3_published_16k=FA3_PUBLISHED.get((mask, direction), "") if d == 128 else "",
                                   note="")
                        rows.append(row)
                        limit = device_bytes()
                        if impl == "xla" and limit and 3 * b * h * s * s * 4 > 0.8 * limit:
                            row["note"] = f"skipped: materialises [B,H,S,S] ({b * h * s * s * 4 / 2**30:.0f} GiB f32)"
                            continue
                        try:
                            attn = attention_fn(impl, causal, d, cpu, seg)
                            if direction == "fwd":
                                fn, call_args = jax.jit(attn), (q, k, v)
                                outputs[impl] = fn(*call_args)
                            else:
                                fn, call_args = jax.jit(fwd_bwd(attn)), (q, k, v, do)
                            t = median_seconds(fn, *call_args, warmup=args.warmup, iters=args.iters)
                        except Exception as e:  # OOM, unsupported shape or backend: a note, not a crash
                            row["note"] = short_error(e)
                            continue
                        finally:
                            gc.collect()
                        row.update(ms=f"{t * 1e3:.3f}", tflops=f"{flops / t / 1e12:.3g}",
                                   pct_peak=f"{100 * flops / t / 1e12 / peak:.0f}")
                        print(f"S={s:6d} D={d:3d} {mask:6s} {direction:7s} {impl:10s} "
                              f"{t * 1e3:9.3f} ms {flops / t / 1e12:7.3g} TFLOP/s", flush=True)
                        if direction == "fwd":
                            fwd_ms[impl] = t * 1e3
                        elif impl in fwd_ms and t * 1e3 > fwd_ms[impl]:  # backward alone: the difference
                            bwd_t = t - fwd_ms[impl] / 1e3
                            rows.append(dict(row, direction="bwd", ms=f"{bwd_t * 1e3:.3f}",
                                             tflops=f"{2.5 * fwd_flops / bwd_t / 1e12:.3g}",
                                             pct_peak=f"{100 * 2.5 * fwd_flops / bwd_t / 1e12 / peak:.0f}",
                                             estimate_tflops=estimate(impl, d, mask, "bwd", s),
                                             fa3_published_16k=FA3_PUBLISHED.get((mask, "bwd"), "") if d == 128
                                             else "", note=""))
                    _relative_columns([r for r in rows if r["seq_len"] == s and r["head_dim"] == d
                                       and r["mask"] == mask and r["direction"] == direction], outputs)
                _relative_columns([r for r in rows if r["seq_len"] == s and r["head_dim"] == d
                                   and r["mask"] == mask and r["direction"] == "bwd"], {})
                outputs.clear()
            del q, k, v, do
    return rows, peak


def packed_segment_ids(b: int, s: int, *, seed: int, docs: int = 8):
    """[B, S] int32 ids of ``docs`` documents of random lengths per row (packed training data)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    cuts = np.stack([np.sort(rng.choice(np.arange(1, s), size=docs - 1, replace=False)) for _ in range(b)])
    # documents 1..docs, as the packer numbers them (0 is padding)
    return jnp.asarray(np.stack([np.searchsorted(c, np.arange(s), side="right") + 1 for c in cuts]), jnp.int32)


def estimate(impl: str, d: int, mask: str, direction: str, s: int) -> str:
    """Our kernel's static estimate, "best / no overlap" TFLOP/s (an estimate, ``flash_estimate.py``)."""
    if impl != "ours" or direction == "fwd+bwd" or jax.default_backend() == "cpu":  # an H100 estimate
        return ""
    from ulysses_jax.kernels.flash_estimate import attention_fractions, tflops

    a = attention_fractions(d, jnp.bfloat16, causal=mask != "full", segment_ids=mask == "packed", seq_len=s)
    which = a["forward" if direction == "fwd" else "backward"]
    return f"{tflops(which['best']):.0f} / {tflops(which['no_overlap']):.0f}"


def _relative_columns(group, outputs):
    by_impl = {r["impl"]: r for r in group}
    cudnn = by_impl.get("cudnn")
    base = "cudnn" if "cudnn" in outputs else "xla" if "xla" in outputs else None
    for r in group:
        if cudnn and cudnn["ms"] and r["ms"]:
            r["vs_cudnn"] = f"{float(cudnn['ms']) / float(r['ms']):.2f}"
        if r["direction"] == "fwd" and base and r["impl"] in outputs:
            diff = jnp.max(jnp.abs(outputs[r["impl"]].astype(jnp.float32) - outputs[base].astype(jnp.float32)))
            r["max_abs_diff"] = f"{float(diff):.2e}"


def header(args, peak):
    return run_header(
        workload=f"bf16, B*S = {args.tokens} tokens (B >= 1), H = Hkv = {args.heads}",
        **{"matmul peak": f"{peak:.3g} TFLOP/s (bf16 {matmul_size()}^3 matmul, measured)"},
    )


def write_results(rows, meta, out_dir: pathlib.Path):
    kind = jax.devices()[0].device_kind.lower().replace(" ", "-")
    stem = out_dir / f"attention_{kind}_{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    written = write_table(stem, "Attention benchmark", meta, list(rows[0]) if rows else [], rows)
    if _plot(rows, meta, f"{stem}.png"):
        written.append(f"{stem}.png")
    return written


def _plot(rows, meta, path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return False
    panels = sorted({(r["head_dim"], r["mask"], r["direction"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), squeeze=False)
    for ax, (d, mask, direction) in zip(axes[0], panels):
        for impl in IMPLS:
            pts = [(r["seq_len"], float(r["tflops"])) for r in rows if r["impl"] == impl and r["tflops"]
                   and (r["head_dim"], r["mask"], r["direction"]) == (d, mask, direction)]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set(xscale="log", xlabel="sequence length", ylabel="TFLOP/s",
               title=f"D={d} {mask} {direction}")
        ax.legend(fontsize=7)
    fig.suptitle(f"{meta['hardware']}  {meta['date']}  {meta['commit'][:10]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None):
    args = parse_args(argv)
    if jax.default_backend() == "cpu" and not args.allow_cpu:
        print("bench_attention: no GPU (jax.default_backend() == 'cpu'); pass --allow-cpu for a tiny smoke run",
              file=sys.stderr)
        return 2
    rows, peak = run(args)
    meta = header(args, peak)
    for path in write_results(rows, meta, args.out_dir):
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
