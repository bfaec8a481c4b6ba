"""What the compiled step actually runs, counted from its optimised HLO: the FLOPs of every matmul (its dots, and the
cuBLAS GEMM calls XLA makes of them with Triton's GEMMs off: ``hlo.gemm_flops``) and the work of every attention
forward kernel, each times how often it runs per step (loop trips included, ``hlo.multiplicities``).

The estimate (``estimate.py``) reads the re-runs from these counts instead of from the flags: a flag rule undercounts
nested checkpoints (``--remat-every k`` re-runs a group's forward and then each layer's inside it), an attention
kernel that is not a saveable dot, or a tiled loss that re-runs the unembedding. Attention kernels counted: cuDNN's
fused attention (``__cudnn$fmha*`` custom calls) and our Pallas kernel (Triton custom calls named
``flash_attention_fwd``); attention written as XLA ops (``xla``, ``blockwise``) is not told apart from other matmuls,
so the estimate keeps its flag rule there. The experts' grouped matmuls (``kernels/grouped_matmul.py``: Triton custom
calls named ``grouped_matmul``, ``grouped_matmul_dx``, ``grouped_matmul_dw``) are matmuls too: ``2 x rows x K x N``
each, padding rows included, counted apart (``grouped_flops``) and added to the dots' FLOPs by the estimate.
"""

from __future__ import annotations

import dataclasses
import math
import re

from ulysses_jax.plan import hlo

_DIMS = re.compile(r"\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class ProgramWork:
    dot_flops: float  # every dot of the program, per device per step
    attention_forward_work: float  # sum over forward kernel runs of B * heads * S_q * S_kv * head_dim
    attention_forward_calls: int  # forward kernel runs per step
    attention_kernel: str | None  # "cudnn", "pallas" or None (no attention kernel found)
    grouped_flops: float = 0.0  # the experts' grouped matmul kernels, per device per step


def _dims(type_text: str) -> list[int]:
    m = _DIMS.search(type_text)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _forward_kernel(ins) -> str | None:
    if ins.opcode != "custom-call":
        return None
    target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
    target = target.group(1) if target else ""
    if target.startswith("__cudnn$fmha") and "Backward" not in target:
        return "cudnn"
    if "triton" in target and "flash_attention_fwd" in ins.attrs:
        return "pallas"
    return None


def branch_shares(model) -> dict[int, tuple[float, ...]]:
    """How often each branch of the model's conditionals runs per layer (``hlo.multiplicities``): the layer-kind switch
    (attention kinds, then the delta-net: ``layer_kinds.kind_index``) and, with dense and sparse layers mixed, the MLP's
    ``cond`` (branch 0 dense, 1 experts). Two conditionals of the same arity with other shares: neither is given (each
    branch counted equally often)."""
    shares: dict[int, tuple[float, ...]] = {}
    clash = set()
    n = model.num_layers

    def give(counts):
        key, value = len(counts), tuple(c / n for c in counts)
        if shares.get(key, value) != value:
            clash.add(key)
        shares[key] = value

    kinds = list(model.kind_of_layer) if model.mixed_layer_kinds else []
    if kinds:
        give([kinds.count(i) for i in range(max(kinds) + 1)])
    if model.num_experts and model.has_dense_mlp:
        sparse = len(model.sparse_layers)
        give([n - sparse, sparse])
    return {k: v for k, v in shares.items() if k not in clash}


def program_work(hlo_text: str, branch_shares: dict[int, tuple[float, ...]] | None = None) -> ProgramWork:
    """Count the matmul FLOPs and the attention forward work of an optimised HLO module (module doc); a conditional's
    branches by ``branch_shares`` (``hlo.multiplicities``)."""
    comps, entry = hlo.parse(hlo_text)
    mult = hlo.multiplicities(comps, entry, branch_shares) if entry else {}
    flops = work = grouped = 0.0
    calls, kernel = 0, None
    for name, instrs in comps.items():
        times = mult.get(name, 0)
        if not times:
            continue
        types = {ins.name: ins.type for ins in instrs}
        for ins in instrs:
            if (gemm := hlo.gemm_flops(ins, types)) is not None:  # a dot, or a cuBLAS GEMM (Triton's GEMMs off)
                flops += times * gemm
            elif ins.opcode == "custom-call" and "grouped_matmul" in ins.attrs and len(ins.operands) >= 2:
                # operands (metadata, rows [M, K], ...) -> [M, N] or [E, K, N]: 2 M K N either way
                grouped += times * 2.0 * math.prod(_dims(types.get(ins.operands[1], ""))) * _dims(ins.type)[-1]
            elif (which := _forward_kernel(ins)) is not None and len(ins.operands) >= 2:
                q, kv = _dims(types.get(ins.operands[0], "")), _dims(types.get(ins.operands[1], ""))
                if len(q) == 4 and len(kv) == 4:  # [B, S, H, D] (cuDNN's BTNH; our kernel's layout too)
                    b, s_q, h, d = q
                    work += times * b * h * s_q * kv[1] * d
                    calls += times
                    kernel = which
    return ProgramWork(flops, work, calls, kernel, grouped)


def attention_reruns(work: ProgramWork, *, layers: int, batch: int, heads: int, seq_len: int,
                     head_dim: int) -> float | None:
    """Forwards of attention run again in the backward, per layer: the counted forward work over one forward of
    every layer (``batch`` rows, ``heads`` query heads per device, ``seq_len`` tokens each way), less one; None
    when the program calls no attention kernel."""
    once = layers * batch * heads * seq_len * seq_len * head_dim
    if not work.attention_forward_calls or not once:
        return None
    return work.attention_forward_work / once - 1
