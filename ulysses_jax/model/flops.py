"""Parameter and FLOP counts of a ``ModelConfig``, and the model-FLOP utilisation (MFU) they give.

Model FLOPs of one training step (forward + backward; rematerialisation is *not* counted, as is usual
for MFU):

  * matmuls: ``6 * P_mm * tokens``, where ``P_mm`` counts the weights that enter a matmul: q, k, v, o
    projections and the three MLP matrices of every layer (of a sparse layer: its router and the ``k`` experts a
    token visits, the active parameters), plus the ``V x D`` unembedding (its matmul runs whether or not it is tied
    to the embedding). The embedding lookup (a gather), norms, biases, RoPE and
    the softmax are left out: they are elementwise, well under 1% at these sizes.
  * attention scores: per layer, ``Q K^T`` and ``P V`` each cost ``2 * B * S^2 * N * H`` forward, so
    ``12 * L * B * S^2 * N * H`` forward + backward, halved when causal (only the unmasked half counts,
    as in FlashAttention's accounting). Packed rows count each document apart (``document_lengths``: a document of
    ``n`` tokens has ``n^2 / 2`` causal pairs, padding none), as the kernels do the work: a row of four 8K documents
    is a quarter of one 32K sequence's attention. Without ``document_lengths`` a row is one document of ``S`` tokens.
    A local layer with a window of ``W < S`` tokens counts the pairs its window holds, ``S * W - W^2 / 2`` instead of
    ``S^2 / 2`` (``attention_pairs``; the kernels skip the tiles outside the window, ``kernels/window.py``).
  * the gated delta-net (the "linear" layers of Qwen3.5 / Qwen3-Next): its projections are matmul weights like
    attention's (``P_mm``: q, k, v, z, b, a and out for a linear layer, q doubled by the output gate for a
    full-attention one; ``layer_matmul_params`` averages over the layers); its rule counts the matmuls of its chunked
    kernel forward and backward per value head and row (``kernels.gated_delta.gated_delta_flops``, ``backward=True``:
    the kernel's backward recomputes its intra-chunk parts, and no cheaper backward exists), linear in ``S`` and the
    same for a packed row as for one document (the chunks cover the row). The short convolution is elementwise work.
  * LoRA (``cfg.lora``): the FLOPs the step performs, not full fine-tuning's: a frozen weight's matmul runs forward
    and for the input's gradient (``4 * P_mm``: no weight gradient), each adapter's two small matmuls all three ways
    (``6 * r * (in + out)`` per target and layer). ``flops_convention`` says which count a figure uses.

This is the convention of the FlashAttention papers (causal pairs, per document); NVIDIA's formula counts every
layer's full ``S^2`` score matrix and so reads about 2x higher at long context (docs/planning.md).
``flops_per_device`` divides by the number of devices: the work is split evenly across data, fsdp and sp.
"""

from __future__ import annotations

import numpy as np

from ulysses_jax.kernels.gated_delta import gated_delta_flops
from ulysses_jax.kernels.segments import document_lengths
from ulysses_jax.model.config import ModelConfig
from ulysses_jax.model.layer_kinds import layer_windows
from ulysses_jax.model.lora_config import projection_sides

# Dense bf16 peak FLOP/s (no sparsity), from the vendors' datasheets.
PEAK_FLOPS: dict[str, float] = {
    "H100 SXM": 989e12,
    "H100 PCIe": 756e12,
    "H200": 989e12,
    "GH200": 989e12,
    "A100": 312e12,
}


def _mlp_matmul_total(cfg: ModelConfig, experts: int) -> int:
    """Matmul weights of every layer's MLP: a dense layer's ``3 D F``; a sparse layer's router ``D E`` and ``experts``
    of its experts' ``3 D F_e`` (and its shared expert's ``3 D F_s`` and gate ``D``)."""
    d, sparse = cfg.hidden, len(cfg.sparse_layers)
    per_sparse = d * cfg.num_experts + experts * 3 * d * cfg.expert_mlp_dim
    per_sparse += (3 * d * cfg.shared_expert_dim + d) if cfg.shared_expert_dim else 0
    return (cfg.num_layers - sparse) * 3 * d * cfg.mlp_dim + sparse * per_sparse


def mlp_matmul_params(cfg: ModelConfig, *, active: bool = True) -> float:
    """Matmul weights of the MLPs, averaged over the layers (``_mlp_matmul_total``), a sparse layer's ``k`` experts per
    token (``active``) or all ``E`` of them."""
    return _mlp_matmul_total(cfg, cfg.experts_per_token if active else cfg.num_experts) / cfg.num_layers


def attention_matmul_params(cfg: ModelConfig) -> int:
    """Matmul weights of one full-attention layer: q (doubled by the output gate), k, v, o."""
    d, n, k, h = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return d * n * h * (2 if cfg.attn_output_gate else 1) + 2 * d * k * h + n * h * d


def delta_matmul_params(cfg: ModelConfig) -> int:
    """Matmul weights of one delta-net layer: q, k ``D Hk dk``, v, z ``D Hv dv``, b, a ``D Hv``, out ``Hv dv D``."""
    d, hk, hv = cfg.hidden, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    return d * (2 * hk * cfg.linear_key_head_dim + 3 * hv * cfg.linear_value_head_dim + 2 * hv)


def layer_matmul_params(cfg: ModelConfig, *, active: bool = True) -> float:
    """Matmul weights one token passes through in an average layer (``active``: a sparse layer's k experts only)."""
    mixers = (len(cfg.attention_layers) * attention_matmul_params(cfg)
              + len(cfg.linear_layers) * delta_matmul_params(cfg)) / cfg.num_layers
    return mixers + mlp_matmul_params(cfg, active=active)


def delta_rule_flops(cfg: ModelConfig, seq_len: int, rows: int = 1, *, backward: bool = True) -> float:
    """FLOPs of the delta rule in every linear layer over ``rows`` rows of ``seq_len`` tokens, forward + backward
    (module doc), or its forward alone; 0 without linear layers."""
    if not cfg.linear_layers:
        return 0.0
    n = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    per_head = gated_delta_flops(seq_len, cfg.linear_key_head_dim, cfg.linear_value_head_dim, value_per_key=n,
                                 backward=backward)
    return float(rows * len(cfg.linear_layers) * cfg.linear_num_value_heads * per_head)


def matmul_params(cfg: ModelConfig) -> float:
    """``P_mm``: weights that enter a matmul per token, the unembedding included (module doc); the active experts."""
    return cfg.num_layers * layer_matmul_params(cfg) + cfg.vocab_size * cfg.hidden


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one token uses: ``param_count`` with a sparse layer's ``k`` experts in place of all ``E`` (the
    embedding table counted, as Qwen and Mistral count; gpt-oss's model card leaves it out)."""
    per_expert = 3 * cfg.hidden * cfg.expert_mlp_dim
    if cfg.expert_style == "gpt_oss":  # its gate/up and down biases
        per_expert += 2 * cfg.expert_mlp_dim + cfg.hidden
    return param_count(cfg) - len(cfg.sparse_layers) * (cfg.num_experts - cfg.experts_per_token) * per_expert


def param_count(cfg: ModelConfig) -> int:
    """Distinct parameters (a tied unembedding counted once): what the published model cards report, and what the
    model stores (a hybrid's token mixers each stacked over their own layers, ``model/transformer.py``)."""
    d, n, k, h = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn = attention_matmul_params(cfg)  # q (gated: doubled), k, v, o
    attn += (n * h + 2 * k * h) if cfg.qkv_bias else 0
    attn += 2 * h if cfg.qk_norm else 0
    attn += (d if cfg.o_bias else 0) + (n if cfg.attn_sinks else 0)
    per_layer = 2 * d + (2 * d if cfg.post_norms else 0)  # the two norms (four with post_norms)
    mixers = len(cfg.attention_layers) * attn
    if cfg.linear_layers:  # projections; filters, A_log, dt_bias, the gated norm
        channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * (
            cfg.linear_value_head_dim)
        delta = delta_matmul_params(cfg) + channels * cfg.linear_conv_kernel + 2 * cfg.linear_num_value_heads
        mixers += len(cfg.linear_layers) * (delta + cfg.linear_value_head_dim)
    mlp = _mlp_matmul_total(cfg, cfg.num_experts)
    if cfg.expert_style == "gpt_oss":  # router, gate/up and down biases
        e = cfg.num_experts
        mlp += len(cfg.sparse_layers) * (e + e * 2 * cfg.expert_mlp_dim + e * d)
    embeddings = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    return cfg.num_layers * per_layer + mixers + mlp + embeddings + d


def adapter_matmul_params(cfg: ModelConfig) -> float:
    """Per token, the LoRA adapters' matmul weights over every layer: ``r * (in + out)`` per target (0 without LoRA)."""
    if cfg.lora is None:
        return 0.0
    sides = projection_sides(cfg)
    return float(cfg.num_layers * sum(cfg.lora.rank * sum(sides[t]) for t in cfg.lora.targets))


def training_flops(cfg: ModelConfig, *, batch: int, seq_len: int, causal: bool = True,
                   document_lengths: list[list[int]] | None = None) -> float:
    """Model FLOPs of one forward + backward over ``batch`` rows of ``seq_len`` tokens (all devices; module doc).

    ``document_lengths``: per row, the lengths of its documents (``kernels.segments.document_lengths`` of the
    batch's segment ids), each document's attention counted apart; None: each row one document of ``seq_len``.
    A LoRA model (``cfg.lora``) counts the FLOPs the step performs (``flops_convention``)."""
    if document_lengths is not None and len(document_lengths) != batch:
        raise ValueError(f"document_lengths has {len(document_lengths)} rows but batch is {batch}")
    tokens = batch * seq_len
    frozen = 4 if cfg.lora is not None else 6  # a frozen weight: forward and the input's gradient only
    dense = frozen * matmul_params(cfg) * tokens + 6 * adapter_matmul_params(cfg) * tokens
    rows = [[seq_len]] * batch if document_lengths is None else document_lengths
    pairs = sum(attention_pairs(int(n), w, causal=causal) for row in rows for n in row if n > 0
                for w in layer_windows(cfg))
    return float(dense + 12 * pairs * cfg.num_heads * cfg.head_dim + delta_rule_flops(cfg, seq_len, batch))


def flops_convention(cfg: ModelConfig, packed: bool = True) -> str:
    """The count an MFU figure of ``cfg`` uses, in a phrase (for the lines that print one)."""
    what = "causal attention per document" if packed else "causal attention over whole rows"
    if cfg.lora is not None:
        return f"{what}; LoRA: the FLOPs performed (no frozen weight's gradient)"
    return what


def attention_pairs(seq_len: int, window: int | None, *, causal: bool = True) -> float:
    """(query, key) pairs one layer's attention counts: ``S^2``, ``S^2 / 2`` causal, ``S * W - W^2 / 2`` for a
    window ``W < S`` (the causal half with the triangle beyond the window cut off)."""
    if not causal:
        return float(seq_len**2)
    if window is None or window >= seq_len:
        return seq_len**2 / 2
    return seq_len * window - window**2 / 2


def flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = True) -> float:
    """Training FLOPs per token at context ``seq_len``: ``6 * P_mm + 12 * L * N * H * S (/ 2 if causal)`` with every
    layer global (local layers count their window's pairs instead, ``attention_pairs``)."""
    return training_flops(cfg, batch=1, seq_len=seq_len, causal=causal) / seq_len


def flops_per_device(cfg: ModelConfig, *, batch: int, seq_len: int, n_devices: int, causal: bool = True,
                     document_lengths: list[list[int]] | None = None) -> float:
    """``training_flops / n_devices`` for a global batch of ``batch`` rows."""
    return training_flops(cfg, batch=batch, seq_len=seq_len, causal=causal,
                          document_lengths=document_lengths) / n_devices


def batch_flops_per_device(cfg: ModelConfig, segment_ids, *, global_batch: int, n_devices: int) -> float:
    """FLOPs per device of a step over a batch whose rows ``segment_ids [rows, S]`` (NumPy; this process's rows of a
    ``global_batch``) hold: each document's attention apart. With several processes the other processes' rows are
    taken to hold documents like these (the matmul FLOPs are exact, the attention's the local mean)."""
    seg = np.asarray(segment_ids)
    rows = seg.shape[0]
    local = training_flops(cfg, batch=rows, seq_len=seg.shape[1], document_lengths=document_lengths(seg))
    return local * global_batch / max(rows, 1) / n_devices


def peak_flops(device_kind: str) -> float | None:
    """Dense bf16 peak of a ``jax.Device.device_kind`` such as ``"NVIDIA H100 80GB HBM3"`` (None if unknown)."""
    kind = device_kind.upper()
    if "GH200" in kind:
        return PEAK_FLOPS["GH200"]
    if "H200" in kind:
        return PEAK_FLOPS["H200"]
    if "H100" in kind:
        return PEAK_FLOPS["H100 PCIe" if "PCIE" in kind else "H100 SXM"]
    if "A100" in kind:
        return PEAK_FLOPS["A100"]
    return None


def mfu(flops_per_device_per_step: float, step_seconds: float, peak: float) -> float:
    """Model-FLOP utilisation: achieved FLOP/s per device over the device's peak."""
    if step_seconds <= 0 or peak <= 0:
        raise ValueError(f"step_seconds ({step_seconds}) and peak ({peak}) must be positive")
    return flops_per_device_per_step / step_seconds / peak
