"""Packed rows on cuDNN's fused attention, on the GPU at hand: does it match the float32 reference, and what does it
cost beside unpacked cuDNN and our Pallas kernel? (Issue 28's first question; run by experiments/gpu/first_contact.sh.)

    python experiments/probe_cudnn_packed.py --out-dir DIR          # on a Hopper GPU
    python experiments/probe_cudnn_packed.py --allow-cpu --out-dir DIR   # CPU dry run: the reference and our kernel only

Correctness: bf16 inputs, fresh random values, segment ids as the packer writes them (documents 1, 2, ..., padding 0
at the row's end), several rows with different document counts (cudnn-frontend #737 mis-addressed ragged offsets
across rows), documents of length 1, GQA, a window, head_dim 64 and 128. Output and dQ at the real (non-padding) tokens,
dK and dV everywhere, against the float32 XLA reference, the cotangent zero at padding; the tolerance is the GPU tests' bf16 one.
Timing: forward and forward+backward medians (``jax.block_until_ready`` after each call), causal, H=32 / Hkv=8 /
D=128 (--head-dims), one row; cuDNN unpacked, one document at M=1 (the causal mask alone) and M=8, cuDNN packed (8
documents; the bound M on documents per row at 8, 32, 128), ours packed; the temp memory of each compiled
forward+backward. Writes ``cudnn_packed.md`` and ``.csv`` into --out-dir.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from bench_attention import median_seconds  # noqa: E402  (beside this script)
from results_io import run_header, write_table  # noqa: E402

from ulysses_jax.kernels.attention import attention  # noqa: E402
from ulysses_jax.kernels.cudnn_packed import cudnn_packed_attention  # noqa: E402

TOL_BF16 = 2e-2


def packed_ids(rng, rows: int, s: int, docs: int, pad: int, ones: int = 0) -> np.ndarray:
    """``docs`` documents of random lengths (the first ``ones`` of length 1) then ``pad`` padding tokens per row."""
    out = np.zeros((rows, s), np.int32)
    for r in range(rows):
        n = docs + r  # rows differ in document count
        cuts = np.sort(rng.choice(np.arange(ones + 1, s - pad), size=n - 1 - ones, replace=False))
        bounds = np.concatenate([np.arange(ones + 1), cuts, [s - pad]])
        for j in range(n):
            out[r, bounds[j]:bounds[j + 1]] = j + 1
    return out


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def fwd_bwd(fn):
    def f(q, k, v, do):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(do))
    return jax.jit(f)


def check(rng, impl, *, rows, s, h, hkv, d, docs, pad, ones, causal, window):
    ks = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 4)
    q = jax.random.normal(ks[0], (rows, s, h, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (rows, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (rows, s, hkv, d), jnp.bfloat16)
    seg_np = packed_ids(rng, rows, s, docs, pad, ones)
    seg = jnp.asarray(seg_np)
    real = jnp.asarray(seg_np != 0)[:, :, None, None]
    do = jnp.where(real, jax.random.normal(ks[3], (rows, s, h, d), jnp.bfloat16), 0)
    scale = d ** -0.5
    got = fwd_bwd(lambda q, k, v: attention(q, k, v, causal=causal, segment_ids=seg, scale=scale, impl=impl,
                                            window=window))(q, k, v, do)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = fwd_bwd(lambda q, k, v: attention(q, k, v, causal=causal, segment_ids=seg, scale=scale, impl="xla",
                                             window=window))(*f32, do.astype(jnp.float32))
    errs = {}
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if name in ("out", "dq"):  # rows of padding queries are not compared (zero cotangent there)
            g, w = g * seg_np[..., None, None].astype(bool), w * seg_np[..., None, None].astype(bool)
        errs[name] = rel_err(g, w)
    nan = any(bool(np.isnan(np.asarray(x, np.float32)).any()) for x in got)
    return errs, nan


def timing(s, *, h=32, hkv=8, d=128, docs=8, iters=5):
    ks = jax.random.split(jax.random.key(s), 4)
    q = jax.random.normal(ks[0], (1, s, h, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (1, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, s, hkv, d), jnp.bfloat16)
    do = jax.random.normal(ks[3], (1, s, h, d), jnp.bfloat16)
    seg = jnp.asarray(packed_ids(np.random.default_rng(s), 1, s, docs, 0))
    one = jnp.ones((1, s), jnp.int32)
    variants = {
        "cudnn unpacked": lambda q, k, v: attention(q, k, v, causal=True, impl="cudnn"),
        "cudnn packed 1 doc, M=8": lambda q, k, v: cudnn_packed_attention(q, k, v, one, causal=True, scale=d ** -0.5,
                                                                          max_segments=8),
        # --attn-max-documents 1: no packed layout, cuDNN's causal mask alone with the padding zeroed around it (the
        # H200's training steps of 2026-11-28 ran faster with M = 1, then cuDNN's padding mask, than with the default
        # bound): beside "unpacked", the cost of that zeroing
        "cudnn 1 doc, M=1": lambda q, k, v: cudnn_packed_attention(q, k, v, one, causal=True, scale=d ** -0.5,
                                                                   max_segments=1),
    }
    for m in (8, 32, 128):
        variants[f"cudnn packed {docs} docs, M={m}"] = (
            lambda q, k, v, m=m: cudnn_packed_attention(q, k, v, seg, causal=True, scale=d ** -0.5, max_segments=m))
    variants[f"ours packed {docs} docs"] = lambda q, k, v: attention(q, k, v, causal=True, segment_ids=seg,
                                                                     impl="pallas")
    rows = []
    for name, fn in variants.items():
        try:
            compiled = fwd_bwd(fn).lower(q, k, v, do).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
            t_f = median_seconds(jax.jit(fn), q, k, v, warmup=2, iters=iters)
            t_fb = median_seconds(compiled, q, k, v, do, warmup=2, iters=iters)
            rows.append({"what": f"S={s} D={d} {name}", "fwd_ms": f"{1e3 * t_f:.2f}", "fwd_bwd_ms": f"{1e3 * t_fb:.2f}",
                         "temp_gib": f"{temp / 2**30:.2f}"})
        except Exception as e:  # noqa: BLE001 - recorded as a row note
            rows.append({"what": f"S={s} D={d} {name}", "note": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=pathlib.Path, required=True)
    p.add_argument("--allow-cpu", action="store_true")
    p.add_argument("--seq-lens", type=lambda x: [int(t) for t in x.split(",")], default=[32768])
    p.add_argument("--head-dims", type=lambda x: [int(t) for t in x.split(",")], default=[128],
                   help="the timing's head dims (64: llama3.2-1b's)")
    args = p.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    if not gpu and not args.allow_cpu:
        print("probe_cudnn_packed: no GPU; pass --allow-cpu for a dry run", file=sys.stderr)
        return 2
    impl = "cudnn" if gpu else "pallas"
    s = 4096 if gpu else 256
    rng = np.random.default_rng(0)
    cases = {  # name: (rows, h, hkv, d, docs, pad, ones, causal, window, max_segments)
        "many docs + padding, MHA": (3, 8, 8, 128, 12, 300, 0, True, None, 32),
        "docs of length 1, GQA 8/2": (2, 8, 2, 128, 10, 0, 3, True, None, 16),
        "one doc per row, MQA": (2, 4, 1, 128, 1, 0, 0, True, None, 4),
        "window 512, GQA, padding": (2, 8, 2, 128, 6, 100, 0, True, 512 if gpu else 32, 8),
        "head_dim 64, padding": (2, 8, 4, 64, 5, 64, 0, True, None, 8),
        "not causal, GQA": (2, 8, 2, 128, 5, 64, 0, False, None, 8),
    }
    rows = []
    for name, (r, h, hkv, d, docs, pad, ones, causal, window, _) in cases.items():
        if not gpu:
            pad, d = min(pad, 16), min(d, 64)
        try:
            errs, nan = check(rng, impl, rows=r, s=s, h=h, hkv=hkv, d=d, docs=docs, pad=pad, ones=ones, causal=causal,
                              window=window)
            ok = not nan and max(errs.values()) < TOL_BF16
            row = {"what": f"{impl} vs f32 reference: {name}", **{k: f"{e:.2e}" for k, e in errs.items()},
                   "note": ("PASS" if ok else "FAIL") + (" (NaN)" if nan else "")}
        except Exception as e:  # noqa: BLE001
            row = {"what": f"{impl} vs f32 reference: {name}", "note": f"ERROR {type(e).__name__}: "
                                                                       f"{str(e).splitlines()[0][:200]}"}
        print(row, flush=True)
        rows.append(row)
    if gpu:
        for d in args.head_dims:
            for sl in args.seq_lens:
                rows += timing(sl, d=d)
    meta = run_header(workload=f"checks at S={s} bf16; timing causal, 1 row, H=32, Hkv=8, D={args.head_dims}")
    cols = ["what", "out", "dq", "dk", "dv", "fwd_ms", "fwd_bwd_ms", "temp_gib", "note"]
    print("wrote", *write_table(args.out_dir / "cudnn_packed", "cuDNN packed attention probe", meta, cols, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
