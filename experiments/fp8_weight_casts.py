"""Count the float8 weight casts in a compiled step: fusions whose result is an ``f8e4m3fn`` array shaped like a
projection weight (q, k, v, o: any number of heads, as a head group's cut or a shard has; gate, up, down), times how
often each runs per step (``plan.hlo.executed``: the loops' trip counts multiplied in).

    ulysses-jax plan --preset llama3.1-8b ... --fp8 --hlo-out step.hlo
    python experiments/fp8_weight_casts.py --preset llama3.1-8b step.hlo [more.hlo ...]

The hidden dimension matches whole or split ``--shards`` ways (a weight quantised where it rests). Shapes are compared
as sorted dims (a transposed copy counts), so compile with chunk sizes (``--attn-chunk``, ``--mlp-chunk``) that are
none of the model's dims: a chunk's activations ``[1, chunk, heads, head_dim]`` would otherwise count as a weight. No
time is claimed: this reads the program, and says how many times it makes a float8 weight.
"""

from __future__ import annotations

import argparse
import collections
import re

from ulysses_jax.model.config import PRESETS
from ulysses_jax.plan import hlo


def weight_dims(cfg, shards: int) -> set[tuple[int, ...]]:
    """The sorted non-unit dims of every projection weight shape of ``cfg`` (a ``ModelConfig``; any head count)."""
    d, hd = cfg.hidden, cfg.head_dim
    out = set()
    for e in {d, d // shards}:
        for h in range(1, 2 * cfg.num_heads + 1):  # 2x: a gated q_proj
            out.add(tuple(sorted(x for x in (e, h, hd) if x > 1)))
        out.add(tuple(sorted((e, cfg.mlp_dim))))
    return out


def casts(text: str, dims: set[tuple[int, ...]]) -> collections.Counter:
    """``{result dims: runs per step}`` of the fusions that make a float8 weight."""
    found = collections.Counter()
    for ins, times in hlo.executed(text):
        if ins.opcode != "fusion":
            continue
        for shape in re.findall(r"f8e4m3fn\[([\d,]*)\]", ins.type):
            if tuple(sorted(int(x) for x in shape.split(",") if x and int(x) > 1)) in dims:
                found[shape] += times
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hlo", nargs="+", help="optimised HLO files (plan --hlo-out)")
    ap.add_argument("--preset", required=True, help="the model preset the program was compiled for")
    ap.add_argument("--shards", type=int, default=8, help="ways the hidden dimension is split at rest (default 8)")
    args = ap.parse_args()
    dims = weight_dims(PRESETS[args.preset], args.shards)
    for path in args.hlo:
        with open(path) as f:
            found = casts(f.read(), dims)
        print(f"{path}: {int(sum(found.values())):,} float8 weight casts per step "
              f"({', '.join(f'[{s}] x{int(n)}' for s, n in found.most_common())})")


if __name__ == "__main__":
    main()
