"""Time the experts' grouped matmul on a GPU: forward and forward+backward of ``kernels/grouped_matmul.py`` (Pallas)
against one dense matmul of the same FLOPs, at Qwen3-30B-A3B's expert shapes (hidden 2048, 128 experts of width
768, top-8 routing of random tokens). Prints TFLOP/s; needs a GPU.

    python experiments/bench_grouped_matmul.py [--tokens 8192] [--iters 10]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from ulysses_jax.kernels.grouped_matmul import grouped_matmul


def timed(fn, *args, iters):
    out = fn(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--width", type=int, default=768)
    a = ap.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit("bench_grouped_matmul.py needs a GPU (JAX sees " + jax.default_backend() + ")")
    rng = np.random.default_rng(0)
    m = a.tokens * a.top_k
    choice = np.stack([rng.choice(a.experts, a.top_k, replace=False) for _ in range(a.tokens)]).reshape(-1)
    sizes = jnp.asarray(np.bincount(choice, minlength=a.experts), jnp.int32)
    x = jnp.asarray(rng.normal(size=(m, a.hidden)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(a.experts, a.hidden, a.width)) * 0.02, jnp.bfloat16)
    wd = jnp.asarray(rng.normal(size=(a.hidden, a.width)) * 0.02, jnp.bfloat16)
    flops = 2.0 * m * a.hidden * a.width
    gmm = jax.jit(lambda x, w: grouped_matmul(x, w, sizes, impl="pallas"))
    dense = jax.jit(lambda x, w: x @ w)
    loss = jax.jit(jax.grad(lambda x, w: jnp.sum(grouped_matmul(x, w, sizes, impl="pallas").astype(jnp.float32)),
                            argnums=(0, 1)))
    loss_dense = jax.jit(jax.grad(lambda x, w: jnp.sum((x @ w).astype(jnp.float32)), argnums=(0, 1)))
    rows = [("grouped fwd", timed(gmm, x, w, iters=a.iters), flops),
            ("dense fwd (same FLOPs)", timed(dense, x, wd, iters=a.iters), flops),
            ("grouped fwd+bwd", timed(loss, x, w, iters=a.iters), 3 * flops),
            ("dense fwd+bwd (same FLOPs)", timed(loss_dense, x, wd, iters=a.iters), 3 * flops)]
    print(f"{jax.devices()[0].device_kind}: {a.tokens} tokens x top-{a.top_k} = {m} rows, hidden {a.hidden}, "
          f"{a.experts} experts of width {a.width}, bf16")
    for name, s, f in rows:
        print(f"  {name:28s} {s * 1e3:8.3f} ms  {f / s / 1e12:6.1f} TFLOP/s")


if __name__ == "__main__":
    main()
