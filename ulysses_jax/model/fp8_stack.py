"""Full fine-tuning with ``--fp8`` on unsplit weights: the whole layer stack quantised once a step, before the loop.

Where the weights are not split (one GPU, or data parallelism alone: the FSDP axes of size 1), each layer's projection
used to be quantised inside the layer loop, from the layer's slice of the stacked parameter. Hopper's float8 GEMMs read
both operands with the contracted dimension contiguous, and the forward and the input gradient contract a weight on
opposite dimensions; XLA met that by laying the whole stacked parameter out again before the loop, in the parameters'
own dtype: a float32 copy of every stacked projection weight, every step (llama3.2-1b: 3.62 GiB; the copies a LoRA base
at rest in float8 also removed, ``fp8_base``). Transposing the float8 weight inside the layer did not help: layout
assignment moved the transpose onto the stack again.

Here the step quantises each stack before the layer loop, each layer with its own scale, exactly as the loop did (the
compute-dtype weight, ``fp8._role``; the delayed recipe's history row of the layer), into both layouts: ``q`` ``[L,
in..., out...]`` for the input gradient and ``qt`` ``[L, out..., in...]`` for the forward (``fp8.Quantized``). The loop
slices them like the parameters and each projection takes its float8 weight as it is (``fp8.carried``: the parameter's
own slice carries the weight gradient, so nothing else changes). Two float8 copies take half the bytes of the one
float32 copy, and the weights are no longer quantised again when remat re-runs a layer. The values are those of the
loop bit for bit (tests/test_fp8_stack.py).

Applies to the plain attention and MLP sublayers, the tiled MLP and a hybrid's delta-net (each mixer stacked over its
own layers is read by row, as its parameters are: ``transformer.layer_rows``). The delta-net's q, k, v and z run as one
GEMM on their weights side by side with one scale per layer, so they are quantised side by side (``QKVZ``), its output
projection alone. The tiled attention sublayer takes q, k, v and o in the first layout alone (its head groups cut that
copy; the other layout XLA makes from the float8 stack, one byte an element). Not with ``--delta-head-chunk`` (each
head group takes its own scale: quantised in the loop); LoRA's frozen base rests in float8 already.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ulysses_jax.model import fp8
from ulysses_jax.model.delta_net import FP8_WEIGHTS, QKVZ, group_heads
from ulysses_jax.model.fp8_base import WEIGHTS, output_first
from ulysses_jax.parallel.sharding import axes_size, fsdp_axes


def modules(cfg, mesh: Mesh) -> tuple[str, ...]:
    """The modules (``fp8_base.WEIGHTS`` keys) whose stacks ``cfg``'s step quantises before the layer loop on ``mesh``:
    none without ``--fp8``, with LoRA (its base rests in float8), ``--offload-params`` (the layers stream in one by
    one), split weights (each layer's gather moves float8 already) or experts; no ``delta`` in head groups (module
    doc)."""
    if (not cfg.fp8 or cfg.lora is not None or cfg.offload_params or cfg.num_experts
            or axes_size(mesh, fsdp_axes(cfg.shard_params_over_data)) != 1):
        return ()
    attn = ("attn",) if cfg.attention_layers else ()
    delta = ("delta",) if cfg.linear_layers and len(group_heads(cfg, 1)[0]) == 1 else ()
    return attn + delta + ("mlp",)


def _stacks(state, module: str, dt, transposed: bool = True) -> dict:
    """``{weight: fp8.Quantized}`` of ``module``'s stacked state: each projection weight in ``dt``, quantised per row
    (``[rows]`` scales and amaxes; the delayed recipe's history row of each), in both layouts (``transposed=False``:
    the first alone, for the tiled attention sublayer, whose head groups cut it)."""
    history = state["fp8_history"].get_value() if "fp8_history" in state else None  # [rows, projections, 3, H]
    weights = {attr: (state[attr].get_value().astype(dt), n_in, None if history is None else history[:, i])
               for i, (attr, n_in) in enumerate(WEIGHTS[module])}
    if module == "delta":  # q, k, v, z side by side (one scale per layer, as the one GEMM takes it); no history
        side = [weights.pop(a)[0] for a in FP8_WEIGHTS[:4]]
        weights = {QKVZ: (jnp.concatenate([a.reshape(*a.shape[:2], -1) for a in side], axis=2), 1, None), **weights}
    out = {}
    for attr, (w, n_in, rows) in weights.items():
        q = jax.vmap(fp8.prequantize)(w, rows)
        out[attr] = dataclasses.replace(q, qt=q.q.transpose(output_first(w.ndim, n_in))) if transposed else q
    return out


def quantized(blocks, own, cfg, mesh: Mesh) -> tuple[dict, list]:
    """``(scanned, apart)``: ``modules``' projection stacks quantised (``_stacks``), from ``transformer.split_block``'s
    state stacked over every layer (``blocks``: ``scanned``, ``{module: {weight: fp8.Quantized}}``, sliced by the layer
    scan) and its modules stacked over their own layers (``own``: ``apart``, ``[({module: ...}, rows [L])]``, read by
    row as their parameters are: ``transformer.layer_rows``). Empty when nothing applies."""
    mods, dt = modules(cfg, mesh), cfg.compute_jnp_dtype

    def stacks(state, m):
        return _stacks(state[m], m, dt, transposed=not (m == "attn" and cfg.attn_chunk))

    scanned = {m: stacks(blocks, m) for m in mods if m not in cfg.stacked_apart}
    apart = [({m: stacks(state, m)}, rows) for (state, rows), m in zip(own, cfg.stacked_apart) if m in mods]
    return scanned, apart
