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
slices them like the parameters and each projection takes its float8 weight as it is (``fp8.Carried``: the parameter's
own slice carries the weight gradient, so nothing else changes). Two float8 copies take half the bytes of the one
float32 copy, and the weights are no longer quantised again when remat re-runs a layer. The values are those of the
loop bit for bit (tests/test_fp8_stack.py).

Applies to the plain attention and MLP sublayers and the tiled MLP of a model without delta-net layers; the tiled
attention sublayer keeps its own per-layer quantisation, and LoRA's frozen base rests in float8 already.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh

from ulysses_jax.model import fp8
from ulysses_jax.model.fp8_base import WEIGHTS, output_first
from ulysses_jax.parallel.sharding import axes_size, fsdp_axes


def modules(cfg, mesh: Mesh) -> tuple[str, ...]:
    """The modules (``fp8_base.WEIGHTS`` keys) whose stacks ``cfg``'s step quantises before the layer loop on ``mesh``:
    none without ``--fp8``, with LoRA (its base rests in float8), ``--offload-params`` (the layers stream in one by
    one), split weights (each layer's gather moves float8 already), delta-net layers or experts; no ``attn`` with the
    tiled attention sublayer."""
    if (not cfg.fp8 or cfg.lora is not None or cfg.offload_params or cfg.linear_layers or cfg.num_experts
            or axes_size(mesh, fsdp_axes(cfg.shard_params_over_data)) != 1):
        return ()
    return ("mlp",) if cfg.attn_chunk else ("attn", "mlp")


def quantized(blocks, cfg, mesh: Mesh) -> dict:
    """``{module: {weight: fp8.Quantized}}`` of the stacked block state ``blocks`` (``transformer.split_block``): each
    of ``modules``' projection weights in the compute dtype, quantised per layer (``[L]`` scales and amaxes), in both
    layouts. ``{}`` when nothing applies."""
    out = {}
    dt = cfg.compute_jnp_dtype
    for module in modules(cfg, mesh):
        state = blocks[module]
        history = state["fp8_history"].get_value() if "fp8_history" in state else None  # [L, projections, 3, H]
        out[module] = {}
        for i, (attr, n_in) in enumerate(WEIGHTS[module]):
            w = state[attr].get_value().astype(dt)
            rows = None if history is None else history[:, i]
            q = jax.vmap(fp8.prequantize)(w, rows)
            out[module][attr] = dataclasses.replace(q, qt=q.q.transpose(output_first(w.ndim, n_in)))
    return out


def carried(w: jax.Array, ready: dict | None, attr: str):
    """``w`` (one layer's weight in the compute dtype) as ``fp8.Carried`` with its float8 form from ``ready`` (one
    layer's row of ``quantized``'s module), or ``w`` itself when ``ready`` has none."""
    if ready is None or attr not in ready:
        return w
    return fp8.Carried(w, ready[attr])
