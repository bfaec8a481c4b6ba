"""``ModelConfig``: the frozen description of a Llama / Qwen / Mistral-family transformer, with presets.

Presets carry the shapes of the published checkpoints (Hugging Face ``config.json`` of each model); each family's
module (``model/families/``) holds its own and tabulates them in its docstring:

| family     | presets                                                   | module                       |
|------------|-----------------------------------------------------------|------------------------------|
| Llama 3.x  | llama3.2-1b, llama3.2-3b, llama3.1-8b, llama3.1-70b       | ``families/llama.py``        |
| Qwen2.5    | qwen2.5-0.5b, qwen2.5-7b (q/k/v bias)                     | ``families/qwen2.py``        |
| Qwen3      | qwen3-0.6b, qwen3-4b, qwen3-8b (qk-norm)                  | ``families/qwen3.py``        |
| Mistral    | mistral-7b (v0.3, no sliding window)                      | ``families/mistral.py``      |
| Qwen3-MoE  | qwen3-30b-a3b (128 experts, top-8, 30.5B / 3.3B active)   | ``families/qwen3_moe.py``    |
| Mixtral    | mixtral-8x7b (8 experts, top-2, 46.7B / 12.9B active)     | ``families/mixtral.py``      |
| gpt-oss    | gpt-oss-20b, gpt-oss-120b (sinks, biases, YaRN, windows)  | ``families/gpt_oss.py``      |
| Gemma 3    | gemma3-1b, gemma3-4b (5 local : 1 global, post-norms)     | ``families/gemma3.py``       |
| Qwen3.5    | qwen3.5-9b, qwen3.5-0.8b (3 delta-net : 1 gated attn)     | ``families/qwen3_5.py``      |
| Qwen3.5-MoE| qwen3.5-35b-a3b (256 experts, top-8, a shared expert)     | ``families/qwen3_5_moe.py``  |
| Qwen3-Next | qwen3-next-80b-a3b (512 experts, top-10, a shared expert) | ``families/qwen3_next.py``   |

Three CPU-sized models for smoke runs live here: ``tiny``, a GQA model of 5.2M parameters; ``tiny-moe``, eight
experts (top-2, renormalised, qk-norm) with one dense layer among three sparse ones; ``tiny-hybrid``, Qwen3.5's layer
(three gated delta-net layers, 4 key / 8 value heads of 32, to one output-gated full-attention layer) at ``tiny``'s
width. Variations:
``dataclasses.replace(cfg, ...)``, which re-runs the validation, so an invalid combination raises ``ValueError`` at
once.

The long-context memory switches (each tested for equality with the plain path):
  * ``loss_chunk``: tokens per chunk of each device's sequence for the tiled loss (0 = plain loss).
  * ``mlp_chunk``: tokens per chunk of each device's sequence for the tiled MLP (0 = plain MLP).
  * ``attn_chunk``: tokens per chunk of each device's sequence for the tiled attention sublayer: norm,
    projections and the Ulysses all-to-alls chunk by chunk around one whole-sequence kernel call
    (``tiled_attention.py``; 0 = plain; needs ``ring = 1``).
  * ``attn_head_chunk``: with ``attn_chunk``, query heads per group of the tiled attention on each device: the
    heads are projected, exchanged and run through the kernel one group at a time, so the kernel's
    whole-sequence operands and gradients exist for one group only (0 = all of a device's heads at once).
  * ``attn_recompute``: with ``attn_chunk``, the tiled attention keeps no output for its backward, where each
    group's kernel forward runs again (one more attention forward per layer, one ``[S/sp, D]`` buffer less).
    Refused with ``post_norms`` (Gemma 3), whose post-attention norm's backward reads that output.
  * ``remat``: per-layer rematerialisation policy, one of ``REMAT_POLICIES``.
  * ``remat_every``: with ``remat``, keep (or offload) the input of every k-th layer only; the backward re-runs a
    group of k layers, holding their inputs on the device meanwhile (L/k + k saved inputs instead of L).
  * ``fp8`` (not a memory switch; ``fp8_recipe`` ``current`` or ``delayed``): the seven projections' GEMMs in float8,
    close to, not equal to, the plain path (``fp8.py``; refused with experts).
  * ``offload_params``: the stacked layers' parameters live in pinned host memory; the layer scan moves each
    layer's to the device when it runs it and sends its gradient back to host memory (``offload.stream_in``), so
    the device holds one layer of parameters and of gradients at a time. The update must stream too
    (``OptimConfig.offload``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ulysses_jax.model import fp8, hf_config, layer_kinds
from ulysses_jax.model.families import (
    gemma3,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from ulysses_jax.model.layer_kinds import check_layers
from ulysses_jax.model.lora_config import LoraConfig
from ulysses_jax.model.moe_config import EXPERT_STYLES, MOE_IMPLS, check_experts  # noqa: F401

REMAT_POLICIES = ("none", "full", "save_matmuls", "offload")
DTYPES = ("float32", "bfloat16", "float16")
ROPE_TYPES = ("llama3", "linear", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: Llama-3 style (``rope_type: llama3`` in Hugging Face configs), ``linear`` (every
    frequency divided by ``factor``; Gemma 3's global layers), which reads ``factor`` only, or ``yarn`` (gpt-oss, Qwen3
    long-context folders: ``factor``, ``original_max_position``, ``beta_fast``, ``beta_slow``, ``truncate`` and the
    ``attention_factor`` that multiplies cos and sin, 0: ``0.1 ln(factor) + 1``), as transformers computes them."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 0.0

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope scaling rope_type {self.rope_type!r} is not one of {', '.join(ROPE_TYPES)}")
        if self.factor < 1:
            raise ValueError(f"rope scaling factor ({self.factor}) must be >= 1")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"rope scaling needs 0 < low_freq_factor ({self.low_freq_factor}) "
                f"< high_freq_factor ({self.high_freq_factor})"
            )
        if self.original_max_position < 1:
            raise ValueError(f"rope scaling original_max_position ({self.original_max_position}) must be positive")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: RMSNorm pre-norm blocks, RoPE, GQA attention, SwiGLU MLP."""

    name: str = "custom"
    vocab_size: int = 256
    num_layers: int = 2
    hidden: int = 64
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 8
    mlp_dim: int = 128
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    qkv_bias: bool = False  # Qwen2.5: bias on the q, k, v projections
    max_seq_len: int = 131_072  # informational: the context length the preset was published with
    init_std: float = 0.02
    param_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    attention_impl: str = "auto"  # passed through to ulysses_attention(impl=...); auto: blockwise on CPU
    shard_params_over_data: bool = False  # ZeRO-3 over data x fsdp x sp instead of fsdp x sp
    loss_chunk: int = 0
    mlp_chunk: int = 0
    attn_chunk: int = 0  # tokens per chunk of each device's sequence for the tiled attention sublayer (0: off)
    attn_head_chunk: int = 0  # with attn_chunk: query heads per device in each group of the kernel (0: all at once)
    attn_recompute: bool = False  # with attn_chunk: no attention output kept for the backward; recomputed there
    # cuDNN's packed attention (GPU): the static bound M on documents per row; its workspace grows with M x seq
    # (kernels/cudnn_packed.py); 1: one document from the row's start, then padding, at no extra memory; 0: by the
    # sequence length (16 up to 32K tokens, 4 at 128K, 1 from 512K)
    attn_max_documents: int = 0
    # with remat: keep each layer's attention output and log-sum-exp (on the device; with remat="offload" in pinned
    # host memory), so the backward runs attention's backward kernel only (parallel/kept.py)
    attn_keep: bool = False
    # with remat full: keep each layer's gated-MLP gate and up products too (LoRA's terms added; model/mlp.py), so
    # the backward runs none of the MLP's GEMMs again: two [tokens, intermediate] per layer on the device
    mlp_keep: bool = False
    remat: str = "none"
    remat_every: int = 1  # with remat: keep the input of every k-th layer only; a group of k layers is re-run
    # with remat='offload' and remat_every > 1: a group's backward offloads its layers' inputs too (pinned host memory,
    # one group's worth), instead of holding them on the device while it runs the group's layers backward
    remat_nested: bool = False
    offload_params: bool = False  # stacked layers' parameters (and gradients) in pinned host memory, one on device
    # the layer loop unrolled (transformer.py): no stacked buffers of the layers' saved values filled and sliced by
    # the loop, more live memory (a speed tool: same values; not with offload_params)
    scan_unroll: bool = False
    # Per-layer attention (model/layer_kinds.py): ``layer_pattern`` repeats over the layers ("global" / "local"); an
    # empty pattern is all "local" with a sliding_window, else all "global". Local layers see sliding_window tokens.
    sliding_window: int = 0  # tokens a local layer's query sees (itself included); 0: no local layers
    layer_pattern: tuple[str, ...] = ()
    rope_local_theta: float = 0.0  # RoPE base of the local layers, unscaled (Gemma 3: 10000); 0: as the global ones
    # Gemma 3: norms after each sublayer too, norm scales (1 + w), GeGLU, scaled embeddings
    post_norms: bool = False
    norm_plus_one: bool = False
    mlp_activation: str = "silu"
    scale_embeddings: bool = False  # embeddings times sqrt(hidden)
    query_pre_attn_scalar: float = 0.0  # attention scale 1/sqrt(this); 0: head_dim
    o_bias: bool = False  # a bias on the attention's output projection (gpt-oss: attention_bias on all four)
    attn_sinks: bool = False  # a learned sink logit per head in each layer's softmax (gpt-oss; kernels/sinks.py)
    # Mixture of experts (Qwen3-MoE, Mixtral; model/moe.py): 0 experts = a dense MLP in every layer
    num_experts: int = 0
    experts_per_token: int = 0  # top-k of the router
    moe_mlp_dim: int = 0  # an expert's MLP width; 0: mlp_dim (Mixtral). mlp_dim is the dense layers' width
    router_renormalize: bool = False  # the top-k weights renormalised to sum to 1 (Qwen3 norm_topk_prob; Mixtral)
    dense_layers: tuple[int, ...] = ()  # with experts: the layers whose MLP is dense (Qwen3 mlp_only_layers)
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss in the training objective
    moe_impl: str = "auto"  # grouped matmul: auto (pallas on GPUs, ragged_dot elsewhere), pallas, ragged_dot
    # gpt_oss: a router bias, the gate and up projections fused and interleaved with biases, a down bias, and
    # (up + 1) * gate * sigmoid(alpha * gate) with gate <= limit and |up| <= limit
    expert_style: str = "swiglu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # Qwen3-Next / Qwen3.5 (model/delta_net.py): a sigmoid-gated shared expert beside the routed ones (its width; 0:
    # none), attention's output gated per head (q_proj doubled: [q | gate] per head, o * sigmoid(gate) before o_proj),
    # RoPE on the first head_dim * partial_rotary_factor dims of each head, and the gated delta-net layers ("linear"
    # in layer_pattern) with their heads, head dims and short convolution
    shared_expert_dim: int = 0
    attn_output_gate: bool = False
    partial_rotary_factor: float = 1.0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    delta_head_chunk: int = 0  # the delta-net in head groups: value heads per device in each group (0: all at once)
    delta_precision: str = "highest"  # the delta rule's chunk products: highest (float32) or bf16 (gated_delta)
    delta_impl: str = "xla"  # the walk over each block's chunks: xla (a lax.scan) or pallas (gated_delta_scan)
    lora: LoraConfig | None = None  # LoRA adapters (model/lora.py): only they train; None: every parameter
    fp8: bool = False  # the seven projections' GEMMs in float8, forward and backward (model/fp8.py)
    fp8_recipe: str = "current"  # float8 scales: current (this step's amax) or delayed (an amax history)

    def __post_init__(self):
        positive = ("vocab_size", "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                    "max_seq_len")
        for field in positive:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} ({value!r}) must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}) "
                f"for MHA/GQA/MQA"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.rope_theta <= 1:
            raise ValueError(f"rope_theta ({self.rope_theta}) must be > 1")
        if self.rms_eps <= 0 or self.init_std <= 0:
            raise ValueError(f"rms_eps ({self.rms_eps}) and init_std ({self.init_std}) must be positive")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling must be a RopeScaling or None, got {type(self.rope_scaling).__name__}")
        for field in ("param_dtype", "compute_dtype"):
            if getattr(self, field) not in DTYPES:
                raise ValueError(f"{field} {getattr(self, field)!r} is not one of {', '.join(DTYPES)}")
        if not isinstance(self.attention_impl, str) or not self.attention_impl:
            raise ValueError(f"attention_impl ({self.attention_impl!r}) must be a non-empty string such as 'xla'")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat {self.remat!r} is not one of {', '.join(REMAT_POLICIES)}")
        if self.remat_nested and self.remat != "offload":
            raise ValueError(f"remat_nested (--remat-nested) offloads the layer inputs inside a remat_every group: it "
                             f"needs remat='offload', not {self.remat!r}")
        if not isinstance(self.remat_every, int) or self.remat_every < 1 or self.num_layers % self.remat_every:
            raise ValueError(f"remat_every ({self.remat_every!r}) must be a positive divisor of num_layers "
                             f"({self.num_layers})")
        if self.remat_every > 1 and self.remat == "none":
            raise ValueError(f"remat_every ({self.remat_every}, --remat-every) groups the layers that remat re-runs, "
                             f"but remat is 'none'; set remat (--remat full or offload) or drop remat_every")
        for field in ("loss_chunk", "mlp_chunk", "attn_chunk", "attn_head_chunk", "delta_head_chunk"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                what = {"attn_head_chunk": "query heads", "delta_head_chunk": "delta-net value heads"}.get(field,
                                                                                                          "tokens")
                raise ValueError(f"{field} ({value!r}) must be 0 (off) or a positive number of {what} per chunk")
        if self.attn_head_chunk and not self.attn_chunk:
            raise ValueError(f"attn_head_chunk ({self.attn_head_chunk}) groups the heads of the tiled attention "
                             f"sublayer; set attn_chunk too (tokens per chunk, e.g. 4096)")
        if not isinstance(self.attn_recompute, bool):
            raise ValueError(f"attn_recompute ({self.attn_recompute!r}) must be True or False")
        for field in ("attn_keep", "mlp_keep", "fp8", "scan_unroll"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field} ({getattr(self, field)!r}) must be True or False")
        if self.attn_keep and (self.remat == "none" or self.attn_chunk):
            why = ("has nothing to keep without remat: set remat (--remat) to full or offload" if self.remat == "none"
                   else "is for the attention sublayer whole; the tiled one (attn_chunk, --attn-chunk) keeps its own "
                   "output unless attn_recompute: drop one of the two")
            raise ValueError(f"attn_keep (--attn-keep) {why}")
        if self.mlp_keep:
            why = {"none": "has nothing to keep without remat: set remat (--remat) to full",
                   "save_matmuls": "is part of remat save_matmuls, which keeps every matmul's output: drop one of the "
                                   "two",
                   "offload": "keeps the products on the device, for remat full: use --remat full"}.get(self.remat)
            if why is None and self.mlp_chunk:
                why = "keeps the untiled MLP's products: set mlp_chunk (--mlp-chunk) to 0"
            if why is None and self.remat_every > 1:
                why = ("keeps each layer's products, which a group of layers (remat_every) re-runs whole: use "
                       "remat_every 1")
            if why is None and self.num_experts:
                why = "keeps a dense MLP's products, not routed experts'"
            if why is not None:
                raise ValueError(f"mlp_keep (--mlp-keep) {why}")
        m = self.attn_max_documents
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise ValueError(f"attn_max_documents ({m!r}) must be a number of documents per row (1: one document "
                             f"from the row's start; 0: by the sequence length)")
        if self.o_bias and self.attn_chunk:
            raise ValueError("the tiled attention sublayer (attn_chunk, --attn-chunk) takes no output-projection bias "
                             "(o_bias: gpt-oss); use attn_chunk 0")
        f = self.partial_rotary_factor
        if not isinstance(f, (int, float)) or isinstance(f, bool) or not 0 < f <= 1 or int(self.head_dim * f) % 2:
            raise ValueError(f"partial_rotary_factor ({f!r}) must be in (0, 1] with head_dim ({self.head_dim}) x it "
                             f"an even number of rotated dims")
        if self.attn_output_gate and self.post_norms and self.attn_chunk:
            raise ValueError("the tiled attention sublayer (attn_chunk, --attn-chunk) takes an output gate "
                             "(attn_output_gate) or a post-attention norm (post_norms), not both; use attn_chunk 0")
        if self.attn_recompute and not self.attn_chunk:
            raise ValueError("attn_recompute recomputes the output of the tiled attention sublayer; set attn_chunk "
                             "too (tokens per chunk, e.g. 4096)")
        if isinstance(self.layer_pattern, list):  # from JSON (run.json)
            object.__setattr__(self, "layer_pattern", tuple(self.layer_pattern))
        if isinstance(self.dense_layers, list):
            object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        if isinstance(self.lora, dict):  # from JSON (run.json)
            object.__setattr__(self, "lora", LoraConfig(**self.lora))
        if self.lora is not None:
            self.lora.check(self)
        check_layers(self)
        if self.attn_keep and self.remat == "offload" and self.mixed_layer_kinds:
            raise ValueError("attn_keep (--attn-keep) with remat offload is not available for a model that mixes "
                             "layer kinds (local, global or linear layers) (XLA cannot offload the kept outputs from "
                             "inside the layer's switch between its attention kinds); use --remat full --attn-keep, "
                             "or --remat offload without --attn-keep")
        check_experts(self)
        if self.offload_params and self.stacked_apart:  # a row's gradient: a whole stack's in device memory
            what = "token mixers" if self.linear_layers else "dense and sparse MLPs"
            raise ValueError(f"offload_params (--offload-params) streams each layer's parameters from host memory "
                             f"through the layer scan, but this model's {what} are stacked over their own layers and "
                             f"read by row, which it cannot stream yet; train this model without --offload-params")
        if self.scan_unroll and self.offload_params:
            raise ValueError("scan_unroll (--scan-unroll) unrolls the layer loop, which offload_params "
                             "(--offload-params) needs to stream one layer's parameters in at a time; drop one of "
                             "the two")
        fp8.check(self)

    @property
    def expert_mlp_dim(self) -> int:
        """An expert's MLP width (``moe_mlp_dim``, or ``mlp_dim`` when 0)."""
        return self.moe_mlp_dim or self.mlp_dim

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts."""
        if not self.num_experts:
            return ()
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)

    @property
    def has_dense_mlp(self) -> bool:
        """Whether some layer has a dense MLP (every layer of a model without experts)."""
        return len(self.sparse_layers) < self.num_layers

    @property
    def window_kinds(self) -> tuple:
        """The distinct attention kinds of the layers, each a window (``None``: global); see ``layer_kinds``."""
        return layer_kinds.kinds(self)

    @property
    def mixed_layer_kinds(self) -> bool:
        """Whether the layers switch between kinds (local and global attention, or delta-net and attention)."""
        return len(self.window_kinds) + bool(self.linear_layers) > 1

    @property
    def kind_of_layer(self) -> tuple[int, ...]:
        """Per layer, its index into ``window_kinds``."""
        return layer_kinds.kind_index(self)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The layers whose token mixer is the gated delta-net (``"linear"`` in ``layer_pattern``)."""
        return layer_kinds.linear_layers(self)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers whose token mixer is attention."""
        return layer_kinds.attention_layers(self)

    @property
    def stacked_apart(self) -> tuple[str, ...]:
        """The ``Block`` modules stacked over their own layers only (``layer_kinds.stacked_apart``)."""
        return layer_kinds.stacked_apart(self)

    def stacked_layers(self, module: str) -> tuple[int, ...]:
        """The layer each row of the stacked ``Block`` module ``module`` holds (``layer_kinds.stacked_layers``)."""
        return layer_kinds.stacked_layers(self, module)

    def stack_rows(self, module: str) -> tuple[int, ...]:
        """Per layer, the row of ``module``'s stack it reads (``layer_kinds.stack_rows``)."""
        return layer_kinds.stack_rows(self, module)

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates (the first ones): ``head_dim * partial_rotary_factor``."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attn_scale(self) -> float:
        """The attention's softmax scale: 1/sqrt(query_pre_attn_scalar or head_dim)."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def param_jnp_dtype(self):
        return jnp.dtype(self.param_dtype)

    @property
    def compute_jnp_dtype(self):
        return jnp.dtype(self.compute_dtype)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> ModelConfig:
        """The published shapes of ``name`` (see ``PRESETS``), with ``overrides`` replaced."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    @classmethod
    def from_hf(cls, path, **overrides) -> ModelConfig:
        """The shapes of a Hugging Face model folder's ``config.json`` (a family of ``model/families/``, read by
        ``model/hf_config.py``), with ``overrides`` replaced. Unsupported settings raise ``ValueError`` naming the
        field."""
        fields = hf_config.config_fields(path)
        if fields.get("rope_scaling") is not None:
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        known = {f.name for f in dataclasses.fields(cls)}
        for key in overrides:
            if key not in known:
                raise ValueError(f"{key!r} is not a ModelConfig field; choose from {', '.join(sorted(known))}")
        return cls(**{**fields, **overrides})


def local_chunks(chunk: int, local_seq: int, what: str) -> int:
    """Number of chunks of ``chunk`` tokens in a device's ``local_seq`` tokens; raise if it does not divide."""
    if local_seq % chunk:
        raise ValueError(
            f"{what} ({chunk}) must divide the per-device sequence length ({local_seq} = seq / sp); "
            f"choose a divisor of {local_seq}"
        )
    return local_seq // chunk


def _preset(name: str, fields: dict) -> ModelConfig:
    """A family's preset (plain fields, RoPE scaling as a dict: the families do not import this module)."""
    scaling = fields.get("rope_scaling")
    return ModelConfig(name=name, **{**fields, "rope_scaling": scaling and RopeScaling(**scaling)})


TINY = dict(vocab_size=4096, num_layers=4, hidden=256, num_heads=8, num_kv_heads=4, head_dim=32, mlp_dim=768,
            rope_theta=10_000.0, max_seq_len=4096, compute_dtype="float32")
TINY_MOE = dict(TINY, qk_norm=True, num_experts=8, experts_per_token=2, moe_mlp_dim=128, router_renormalize=True,
                dense_layers=(0,), router_aux_loss_coef=0.001)
TINY_HYBRID = dict(TINY, **{**qwen3_5.HYBRID, "head_dim": 32, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
                              "linear_key_head_dim": 32, "linear_value_head_dim": 32, "max_seq_len": 4096})
# in the order --preset and the unknown-preset message list them: the smoke models beside the families'
PRESETS: dict[str, ModelConfig] = {name: _preset(name, fields) for name, fields in {
    "tiny": TINY, **llama.PRESETS, **qwen2.PRESETS, **qwen3.PRESETS, **mistral.PRESETS, **qwen3_moe.PRESETS,
    **mixtral.PRESETS, **gpt_oss.PRESETS, "tiny-moe": TINY_MOE, **gemma3.PRESETS, **qwen3_5.PRESETS,
    "tiny-hybrid": TINY_HYBRID, **qwen3_5_moe.PRESETS, **qwen3_next.PRESETS}.items()}
