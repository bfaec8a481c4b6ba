"""The gated delta rule's forward + backward timed beside flash-linear-attention's and beside cuDNN attention, on the
same GPU in one invocation, with our output checked against flash-linear-attention's on the same inputs.

    python experiments/bench_delta.py                                   # 32K and 128K, Qwen3.5-9B's heads on 1 GPU
    python experiments/bench_delta.py --seq-lens 32768 --heads 2,4      # one device's heads under sp = 8
    python experiments/bench_delta.py --allow-cpu --quick               # CPU dry run (tiny; fla and cuDNN skipped)
    python experiments/bench_delta.py --precision bf16                  # ours with bf16 chunk products only
    python experiments/bench_delta.py --impl pallas                     # ours with the Pallas walk only

Ours: `ulysses_jax.kernels.gated_delta.gated_delta_rule` (jnp, chunked WY form, custom_vjp), bfloat16 inputs, gates from
random `a`, `b` as the layer computes them. The peer: `fla.ops.gated_delta_rule.chunk_gated_delta_rule` from
`flash-linear-attention` / `fla-core` (Triton kernels; carried as wheels; fla 0.6.0 refuses its backward on Hopper GPUs
under Triton 3.4-3.7.0, so on the lent image's Triton 3.6 only its forward is timed; `--fla-site` puts Triton 3.7.1,
cut to 43 MiB by experiments/gpu/slim_triton.py, first on fla's path, where its backward runs), in a child
process (torch) fed the same inputs from .npy files, its L2 norm in the kernel as transformers asks for it. Beside both:
cuDNN's causal attention (`jax.nn.dot_product_attention`) with as many query heads as value heads, head_dim 128, the
same sequence. Each time is the median of --iters after --warmup, forward + backward of sum(o * do), and of the forward
alone (`*_fwd_s`: fla's forward runs where its backward is refused, and its output is the one compared). A row per
sequence length and our `precision` (`highest`: every product float32 at HIGHEST, the default; `bf16`: the chunk
products on bf16 operands with float32 results, as fla computes them) and `impl` (`xla`: the walk over chunks a
lax.scan; `pallas`: the two Pallas kernels of `kernels/gated_delta_scan.py`), with the max abs difference of the outputs
from fla's (bf16 tolerance: ~1e-2 of the outputs' scale) and, for the Pallas rows, from the XLA walk's at the same
precision. Results: markdown + CSV in --out-dir.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",")], default=[32768, 131072])
    p.add_argument("--heads", type=lambda s: tuple(int(x) for x in s.split(",")), default=(16, 32),
                   help="key heads, value heads (Qwen3.5-9B: 16,32 on one device; 2,4 per device under sp = 8)")
    p.add_argument("--dim", type=int, default=128, help="dk = dv")
    p.add_argument("--precision", type=lambda s: s.split(","), default=["highest", "bf16"],
                   help="our kernel's products: highest, bf16, or both (comma-separated)")
    p.add_argument("--impl", type=lambda s: s.split(","), default=["xla", "pallas"],
                   help="our walk over chunks: xla, pallas, or both (comma-separated)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out-dir", type=pathlib.Path, default=HERE / "results")
    p.add_argument("--allow-cpu", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--fla-site", type=pathlib.Path, default=os.environ.get("FLA_SITE") or None,
                   help="a folder put first on the path of fla's process alone (default $FLA_SITE): Triton 3.7.1 "
                        "unpacked there (experiments/gpu/slim_triton.py) runs fla's backward on Hopper")
    p.add_argument("--fla-child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def inputs(seq: int, hk: int, hv: int, d: int, seed: int = 0):
    """NumPy float32 ``q, k [1, S, Hk, d]``, ``v, do [1, S, Hv, d]``, ``a, b [1, S, Hv]`` and the gate parameters."""
    import numpy as np

    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return dict(q=f(1, seq, hk, d), k=f(1, seq, hk, d), v=f(1, seq, hv, d), do=f(1, seq, hv, d), a=f(1, seq, hv),
                b=f(1, seq, hv), A_log=np.log(rng.uniform(1, 16, hv)).astype(np.float32),
                dt_bias=np.ones(hv, np.float32))


def _time(fn, *args, iters: int, warmup: int):
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ours(x: dict, args, precision: str = "highest", impl: str = "xla"):
    """``(seconds, forward seconds, output, gates)`` of our forward + backward and of the forward alone (bfloat16
    inputs) at ``precision`` with ``impl``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ulysses_jax.kernels.gated_delta import gated_delta_rule, gates

    bf = {k: jnp.asarray(v, jnp.bfloat16) for k, v in x.items() if k in ("q", "k", "v", "do")}
    g, beta = gates(jnp.asarray(x["a"]), jnp.asarray(x["b"]), jnp.asarray(x["A_log"]), jnp.asarray(x["dt_bias"]))

    def loss(q, k, v, g, beta, do):
        o = gated_delta_rule(q, k, v, g, beta, precision=precision, impl=impl)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
    forward = jax.jit(lambda *a: loss(*a)[1])
    operands = (bf["q"], bf["k"], bf["v"], g, beta, bf["do"])
    t = _time(step, *operands, iters=args.iters, warmup=args.warmup)
    t_fwd = _time(forward, *operands, iters=args.iters, warmup=args.warmup)
    out = forward(*operands)
    return t, t_fwd, np.asarray(out.astype(jnp.float32)), (np.asarray(g), np.asarray(beta))


def cudnn(seq: int, hv: int, d: int, args):
    """Seconds of cuDNN's causal attention forward + backward, ``hv`` heads of ``d``, one sequence."""
    import jax
    import jax.numpy as jnp

    key = jax.random.key(0)
    q, k, v = (jax.random.normal(jax.random.fold_in(key, i), (1, seq, hv, d), jnp.bfloat16) for i in range(3))

    def loss(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn").astype(
            jnp.float32).sum()

    return _time(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v, iters=args.iters, warmup=args.warmup)


def fla_child(spec: dict) -> int:
    """In its own process: fla's chunk_gated_delta_rule on the saved inputs; prints the forward's time, then the
    forward + backward's (or why fla refused the backward: fla >= 0.5 refuses its gated backward on Hopper under
    Triton 3.4-3.7.0, fla issue 640, while its forward runs), and saves the output. The note names the Triton fla ran
    on (``--fla-site`` puts another first on this process's path)."""
    import numpy as np
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    folder = pathlib.Path(spec["dir"])
    cuda = torch.cuda.is_available()  # the CPU only in the tests, with a stand-in fla
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t = {k: torch.from_numpy(np.load(folder / f"{k}.npy")).to("cuda" if cuda else "cpu")
         for k in ("q", "k", "v", "do", "g", "beta")}
    rep = t["v"].shape[2] // t["q"].shape[2]  # fla wants as many q/k heads as v heads
    q, k = (t[n].repeat_interleave(rep, dim=2).bfloat16().requires_grad_() for n in ("q", "k"))
    v = t["v"].bfloat16().requires_grad_()
    g, beta = t["g"].float().requires_grad_(), t["beta"].bfloat16().requires_grad_()

    def forward():
        with torch.no_grad():
            return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]

    def both():
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        (o.float() * t["do"]).sum().backward()
        return o

    def timed(fn):
        for _ in range(spec["warmup"]):
            fn()
        sync()
        times = []
        for _ in range(spec["iters"]):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    try:
        import triton
        on = f"fla on Triton {triton.__version__}"
    except ImportError:
        on = "fla without Triton"
    result = {"forward_seconds": timed(forward), "seconds": None, "note": on}
    np.save(folder / "fla_out.npy", forward().float().cpu().numpy())
    try:
        result["seconds"] = timed(both)
    except RuntimeError as e:  # the backward refused: the forward's time and output still stand
        result["note"] = f"fla backward: {str(e).splitlines()[0][:200]} ({on})"
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def fla(x: dict, g, beta, args) -> tuple[float | None, float | None, object, str]:
    """``(forward + backward seconds, forward seconds, output, note)`` of fla on ``x``; None: what did not run."""
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        for k in ("q", "k", "v", "do"):
            np.save(pathlib.Path(tmp) / f"{k}.npy", x[k])
        np.save(pathlib.Path(tmp) / "g.npy", g)
        np.save(pathlib.Path(tmp) / "beta.npy", beta)
        spec = json.dumps({"dir": tmp, "iters": args.iters, "warmup": args.warmup})
        site = getattr(args, "fla_site", None)
        failed = ""
        for first in ([site] if site else []) + [None]:  # its Triton before the image's, in this process alone
            env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
            if first:
                env["PYTHONPATH"] = os.pathsep.join([str(first), *filter(None, [env.get("PYTHONPATH")])])
            proc = subprocess.run([sys.executable, __file__, "--fla-child", spec], capture_output=True, text=True,
                                  timeout=900, env=env)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is not None:
                r = json.loads(line[7:])
                return (r["seconds"], r["forward_seconds"], np.load(pathlib.Path(tmp) / "fla_out.npy"),
                        failed + r["note"])
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            if first:  # the carried Triton failed fla: its forward on the image's, as before
                failed = f"fla with --fla-site failed ({tail[0][:120]}), run without it: "
        return None, None, None, f"{failed}fla: {tail[0][:160]}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.fla_child:
        return fla_child(json.loads(args.fla_child))
    import jax
    import numpy as np

    from results_io import run_header, write_table

    gpu = jax.default_backend() == "gpu"
    if not gpu and not args.allow_cpu:
        print("bench_delta: no GPU; pass --allow-cpu for a dry run", file=sys.stderr)
        return 2
    if args.quick:
        args.seq_lens, args.heads, args.dim, args.iters, args.warmup = [256], (2, 4), 32, 1, 1
    hk, hv = args.heads
    rows = []
    kind = jax.devices()[0].device_kind.lower().replace(" ", "-")
    stem = args.out_dir / f"delta_{kind}_{datetime.datetime.now():%Y%m%d-%H%M%S}"
    meta = run_header(model=f"gated delta rule, forward + backward, bf16, heads {hk}/{hv}, d {args.dim}")
    cols = ["seq_len", "heads", "dim", "precision", "impl", "ours_s", "fla_s", "ours_over_fla", "ours_fwd_s",
            "fla_fwd_s", "fwd_ours_over_fla", "cudnn_attention_s",
            "max_abs_diff", "max_abs_diff_vs_xla", "note"]
    paths = []
    for seq in args.seq_lens:
        x = inputs(seq, hk, hv, args.dim)
        peers = None  # fla and cuDNN, timed once per length beside the first of our rows
        xla_out = {}  # the XLA walk's output per precision, what the Pallas rows are compared with
        for precision, impl in ((p, i) for p in args.precision for i in args.impl):
            t_ours, t_ours_fwd, o_ours, (g, beta) = ours(x, args, precision, impl)
            if impl == "xla":
                xla_out[precision] = o_ours
            vs_xla = (f"{float(np.abs(o_ours - xla_out[precision]).max()):.3g}"
                      if impl != "xla" and precision in xla_out else "")
            if peers is None:
                t_fla, t_fla_fwd, o_fla, note = (fla(x, g, beta, args) if gpu
                                                 else (None, None, None, "fla: needs a GPU"))
                peers = (t_fla, t_fla_fwd, o_fla, note, cudnn(seq, hv, args.dim, args) if gpu else None)
            t_fla, t_fla_fwd, o_fla, note, t_cudnn = peers
            diff = float(np.abs(o_ours - o_fla).max()) if o_fla is not None else None
            scale = float(np.abs(o_ours).max())
            rows.append({"seq_len": seq, "heads": f"{hk}/{hv}", "dim": args.dim, "precision": precision, "impl": impl,
                         "ours_s": f"{t_ours:.4f}", "fla_s": "" if t_fla is None else f"{t_fla:.4f}",
                         "ours_over_fla": "" if t_fla is None else f"{t_ours / t_fla:.2f}",
                         "ours_fwd_s": f"{t_ours_fwd:.4f}",
                         "fla_fwd_s": "" if t_fla_fwd is None else f"{t_fla_fwd:.4f}",
                         "fwd_ours_over_fla": "" if t_fla_fwd is None else f"{t_ours_fwd / t_fla_fwd:.2f}",
                         "cudnn_attention_s": "" if t_cudnn is None else f"{t_cudnn:.4f}",
                         "max_abs_diff": "" if diff is None else f"{diff:.3g} (outputs up to {scale:.3g})",
                         "max_abs_diff_vs_xla": vs_xla,
                         "note": note if not gpu or note else ""})
            print(rows[-1], flush=True)
            # the table rewritten after each row: a run stopped at its time limit keeps what it measured
            paths = write_table(stem, "Gated delta rule beside flash-linear-attention", meta, cols, rows)
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
