"""Per-device memory of one training forward + backward, from XLA's ``compiled.memory_analysis()``, with and
without each long-context memory tool: tiled loss, tiled MLP, remat, host offload.

    python experiments/memory_model.py                                  # llama3.2-1b, 32K tokens, fsdp=2 x sp=4
    python experiments/memory_model.py --seq-len 65536 --sp 8 --fsdp 1
    python experiments/memory_model.py --preset tiny --seq-len 4096     # quick check

Nothing runs and no parameter is materialised: the step is lowered on abstract arrays (``nnx.eval_shape``
with the at-rest shardings from the parameters' metadata) and compiled for the mesh, by default on 8 fake
CPU devices, so an 8-GPU program's per-device memory can be read on a laptop. The step is
``jax.value_and_grad(next_token_loss)`` with the gradients laid out like the parameters (the ZeRO-3
reduce-scatter); no optimizer. Per device: ``argument`` (parameter shards + batch), ``output`` (gradient
shards), ``temp`` (everything else the step holds at its peak: activations saved for the backward,
logits, gathered parameters, work buffers). Attention goes through ``--attention-impl`` (default
``pallas``, our flash kernel: linear memory; in interpret mode on CPU; ``xla`` materialises
``[b, H/sp, S, S]`` scores and would dominate every row).

Caveat: the CPU backend has no separate host memory space, so ``remat=offload`` is compiled but its
offloaded residuals stay in the same (host) memory; the row reports XLA's number and the bytes the policy
marks for the host (one ``[b, S/sp, D]`` block input per layer), which a GPU would keep off the device.

Results: a markdown table appended to ``--out`` with date, hardware, command and git commit.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import shlex
import sys
import time

from results_io import git_head  # beside this script


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3.2-1b")
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--batch", type=int, default=None, help="global batch (default: data x fsdp, one row each)")
    p.add_argument("--data", type=int, default=1)
    p.add_argument("--fsdp", type=int, default=2)
    p.add_argument("--sp", type=int, default=4)
    p.add_argument("--loss-chunk", type=int, default=2048, help="tokens per chunk of the local sequence")
    p.add_argument("--mlp-chunk", type=int, default=2048, help="tokens per chunk of the local sequence")
    p.add_argument("--attention-impl", default="pallas")
    p.add_argument("--compute-dtype", default=None, help="override the preset's compute dtype (bfloat16)")
    p.add_argument("--layers", type=int, default=None, help="override num_layers (faster compiles)")
    p.add_argument("--rows", default="plain,tiled_loss,tiled_loss+mlp,+remat_save_matmuls,+remat_full,+offload,"
                   "remat_full_only",
                   help="comma-separated subset of the rows")
    p.add_argument("--out", type=pathlib.Path, default=None, help="markdown file to append the table to")
    p.add_argument("--fake-devices", type=int, default=8, help="fake CPU devices (0: use the real devices)")
    return p.parse_args(argv)


ROWS = {  # row -> ModelConfig overrides (chunk sizes filled in from the arguments)
    "plain": dict(),
    "tiled_loss": dict(loss_chunk=True),
    "tiled_loss+mlp": dict(loss_chunk=True, mlp_chunk=True),
    "+remat_full": dict(loss_chunk=True, mlp_chunk=True, remat="full"),
    "+offload": dict(loss_chunk=True, mlp_chunk=True, remat="offload"),
    "+remat_save_matmuls": dict(loss_chunk=True, mlp_chunk=True, remat="save_matmuls"),
    "remat_full_only": dict(remat="full"),
}


def measure(cfg, mesh, *, batch: int, seq_len: int) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ulysses_jax import Transformer, next_token_loss, param_shardings

    abstract = nnx.eval_shape(lambda: Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = param_shardings(abstract, mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)
    tok_sharding = NamedSharding(mesh, P(("data", "fsdp"), "sp"))
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=tok_sharding)
    batch_spec = dict(tokens=tokens, labels=tokens, segment_ids=tokens)

    def loss(state, batch):
        return next_token_loss(nnx.merge(graphdef, state), batch).loss

    step = jax.jit(jax.value_and_grad(loss), out_shardings=(NamedSharding(mesh, P()), shardings))
    t0 = time.perf_counter()
    compiled = step.lower(state, batch_spec).compile()
    mem = compiled.memory_analysis()
    return dict(
        argument=mem.argument_size_in_bytes,
        output=mem.output_size_in_bytes,
        temp=mem.temp_size_in_bytes,
        host_temp=mem.host_temp_size_in_bytes,
        compile_s=time.perf_counter() - t0,
    )


def gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def main(argv=None):
    args = parse_args(argv)
    if args.fake_devices:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.fake_devices}"
        ).strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import jax

    from ulysses_jax import ModelConfig, make_mesh

    n = args.data * args.fsdp * args.sp
    mesh = make_mesh(data=args.data, fsdp=args.fsdp, sp=args.sp, devices=jax.devices()[:n])
    batch = args.batch or args.data * args.fsdp
    base = ModelConfig.from_preset(args.preset, attention_impl=args.attention_impl)
    if args.layers:
        base = dataclasses.replace(base, num_layers=args.layers)
    if args.compute_dtype:
        base = dataclasses.replace(base, compute_dtype=args.compute_dtype)
    b_local, s_local = batch // (args.data * args.fsdp), args.seq_len // args.sp
    residual_bytes = base.num_layers * b_local * s_local * base.hidden * base.compute_jnp_dtype.itemsize
    results = []
    for row in args.rows.split(","):
        overrides = dict(ROWS[row])
        overrides["loss_chunk"] = args.loss_chunk if overrides.get("loss_chunk") else 0
        overrides["mlp_chunk"] = args.mlp_chunk if overrides.get("mlp_chunk") else 0
        cfg = dataclasses.replace(base, **overrides)
        r = measure(cfg, mesh, batch=batch, seq_len=args.seq_len)
        results.append((row, cfg, r))
        print(f"{row:16s} temp {gib(r['temp'])} GiB  argument {gib(r['argument'])}  output {gib(r['output'])}  "
              f"host temp {gib(r['host_temp'])}  (compiled in {r['compile_s']:.0f} s)", flush=True)

    plain = results[0][2]["temp"]
    lines = [
        f"## {base.name}, {args.seq_len:,} tokens x batch {batch}, "
        f"mesh data={args.data} x fsdp={args.fsdp} x sp={args.sp}",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- hardware: {len(jax.devices())} fake {jax.devices()[0].platform.upper()} devices (compile only; "
        f"memory_analysis of the compiled step)",
        f"- command: `python {shlex.join(['experiments/memory_model.py', *(argv or sys.argv[1:])])}`",
        f"- commit: {git_head()} (jax {jax.__version__})",
        f"- model: {base.num_layers} layers, hidden {base.hidden}, vocab {base.vocab_size}, params float32, "
        f"compute {base.compute_dtype}; attention impl `{args.attention_impl}`; per device b={b_local}, "
        f"S/sp={s_local}; loss_chunk={args.loss_chunk}, mlp_chunk={args.mlp_chunk} tokens",
        "",
        "| configuration | temp GiB / device | vs first row | argument GiB | output GiB | host temp GiB |",
        "|---|---|---|---|---|---|",
    ]
    for row, cfg, r in results:
        lines.append(f"| {row} | {gib(r['temp'])} | {r['temp'] - plain:+,d} B ({gib(r['temp'] - plain)} GiB) | "
                     f"{gib(r['argument'])} | {gib(r['output'])} | {gib(r['host_temp'])} |")
    lines += [
        "",
        f"Offload: the policy marks {base.num_layers} block inputs of {gib(residual_bytes // base.num_layers)} GiB "
        f"({gib(residual_bytes)} GiB per device) for pinned host memory; the CPU backend keeps them in its one "
        f"memory space, so the `+offload` row cannot show that saving here.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with args.out.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
