"""``TrainConfig``: what ``ulysses-jax train`` takes (the CLI flags are generated from it), and the model and data
settings it resolves to.

``model_config`` gives the model a ``TrainConfig`` trains (its preset or ``--init-from-hf``'s config.json, with the
memory tools of the flags), ``model_config_from_run`` the model a run recorded, ``data_config`` its data settings.
The job that runs a ``TrainConfig`` is ``trainer.py``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Annotated, Literal

import tyro

from ulysses_jax.data.documents import DataConfig, DataFormat
from ulysses_jax.model.config import PRESETS, ModelConfig, RopeScaling
from ulysses_jax.model.lora_config import LoraConfig, default_targets
from ulysses_jax.train import runconfig
from ulysses_jax.train.cluster import DEFAULT_PEER_TIMEOUT
from ulysses_jax.train.devices import MeshConfig, build_mesh, check_parallel, resolve_batch  # noqa: F401 (re-exported)
from ulysses_jax.train.step import OptimConfig

COMPUTE_ONLY = runconfig.COMPUTE_ONLY
Paths = Annotated[tuple[str, ...], tyro.conf.arg(metavar="PATH [PATH ...]")]
Impl = Literal["auto", "xla", "blockwise", "pallas", "cudnn"]
Remat = Literal["none", "full", "save_matmuls", "offload"]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Train a model (defaults: the tiny preset on the built-in corpus for 24 steps, Ulysses over the devices)."""

    preset: Annotated[str | None, tyro.conf.arg(metavar="NAME", help=f"model preset: {', '.join(PRESETS)} (not with "
                                                 f"--init-from-hf)")] = "tiny"
    init_from_hf: str | None = None  # a Hugging Face model folder: start from its config.json, weights and tokenizer
    steps: int = 24  # total optimizer steps (a resumed run continues up to this count)
    seq_len: int = 2048  # tokens per row (the context length)
    batch_size: int | None = None  # rows per global batch; None: 2, or one per data x fsdp device if more
    grad_accum: int = 1  # micro-batches per step (normalised by tokens, not by micro-batches)
    mesh: MeshConfig = MeshConfig()
    attention: Impl = "auto"  # attention kernel; auto: blockwise on CPU, cudnn or pallas on GPU
    memory: Literal["auto", "manual"] = "auto"
    """auto: on an H100 or H200, a new run given no memory flag (--remat, --remat-every, --remat-nested, --loss-chunk,
    --mlp-chunk, --attn-chunk, --attn-head-chunk, --delta-head-chunk, --attn-recompute, --attn-keep, --mlp-keep,
    --param-dtype, --offload-params, --optim.offload, --optim.master-weights: MEMORY_SETTINGS) compiles its step with
    each set of memory tools `plan --memory auto` tries and trains with the one of the shortest estimated step that
    fits (of those within 2% of it, the fastest needing at most 75% of the device budget and no host memory, or where
    none does the least memory; on one GPU also tried with the layer loop unrolled), said at start; manual: the flags
    as given, the preset's tools where none is. The two are the same on CPUs, other GPUs and with --resume"""
    remat: Remat | None = None  # rematerialisation per layer; None: the preset's
    remat_every: int | None = None  # with --remat: keep every k-th layer's input, re-run k layers (None: 1)
    remat_nested: bool = False
    """with --remat offload --remat-every k: a group's backward offloads its k layer inputs to pinned host memory too
    (one group's worth more host memory; k-1 [seq/sp, hidden] device buffers less at the peak)"""
    loss_chunk: int | None = None  # tiled loss chunk in tokens (0: off; None: the preset's)
    mlp_chunk: int | None = None  # tiled MLP chunk in tokens (0: off; None: the preset's)
    attn_chunk: int | None = None
    """tiled attention sublayer: norm, projections and the all-to-alls per chunk of this many tokens of each device's
    sequence (0: off; None: the preset's); needs --mesh.ring 1"""
    attn_head_chunk: int | None = None
    """with --attn-chunk: query heads per device in each group of the tiled attention, one group's whole-sequence Q,
    K, V and gradients on the device at a time (0: all of a device's heads at once; None: the preset's)"""
    delta_head_chunk: int | None = None
    """hybrids (Qwen3.5, Qwen3-Next): the delta-net layers in head groups of this many value heads per device, one
    group's whole-sequence buffers on the device at a time (0: all of a device's heads at once; None: the preset's)"""
    delta_precision: Literal["highest", "bf16"] | None = None
    """hybrids: the delta rule's chunk products in float32 at HIGHEST precision (highest) or on bfloat16 operands with
    float32 results (bf16, as flash-linear-attention computes; not yet timed on a GPU); None: the preset's (highest)"""
    delta_impl: Literal["xla", "pallas"] | None = None
    """hybrids: the delta rule's walk over chunks as a lax.scan of XLA ops (xla, the one timed) or as two Pallas
    kernels holding the state on chip (pallas: Triton on GPUs; not yet timed); None: the preset's (xla)"""
    sliding_window: int | None = None
    """tokens a local layer's query sees (the preset's local layers; every layer local if the model has none); None:
    the model's own (not with --init-from-hf: the folder's config.json decides)"""
    attn_recompute: bool = False
    """with --attn-chunk: keep no attention output for the backward, where each head group's kernel forward runs
    again (one more attention forward per layer; one [seq/sp, hidden] buffer less on each device)"""
    attn_keep: bool = False
    """with --remat: keep each layer's attention output and log-sum-exp (on the device; with --remat offload in pinned
    host memory) so the backward runs attention's backward kernel only, not its forward again; not with
    --attn-chunk or a ring"""
    mlp_keep: bool = False
    """with --remat full and --mlp-chunk 0: keep each layer's MLP gate and up products too, so the backward runs none
    of the MLP's GEMMs again (two [tokens, intermediate] per layer on the device; not with mixtures of experts)"""
    attn_max_documents: int | None = None
    """cuDNN's packed attention (GPU): most documents a row may hold (a batch with more is refused before its step);
    its workspace grows with it (~8 B x M x seq x heads/device x head_dim); 1: one document from the row's start, then
    padding, at no extra memory; 0: by --seq-len (16 up to 32K, 4 at 128K, 1 from 512K); None: the run's or 0"""
    router_aux_loss_coef: float | None = None
    """mixture of experts: weight of the load-balancing loss in the objective (logged apart as aux_loss); None: the
    model's (config.json's router_aux_loss_coef, or the preset's)"""
    moe_impl: Literal["auto", "pallas", "ragged_dot"] = "auto"
    """mixture of experts: the grouped matmul; auto: our Pallas kernel on GPUs, jax.lax.ragged_dot elsewhere"""
    param_dtype: Literal["float32", "bfloat16"] | None = None
    """parameters on the devices; None: the preset's (float32). bfloat16 with --optim.master-weights: a float32 copy
    is updated with the optimizer state (in host memory with --optim.offload)"""
    offload_params: bool = False
    """the stacked layers' parameters and gradients in pinned host memory, one layer on the device at a time (needs
    --optim.offload)"""
    scan_unroll: bool = False
    """the layer loop unrolled: no stacked buffers of what the layers save for the backward, zero-filled and sliced
    each step; more device memory, same values (a speed tool: `plan` shows the memory; not with --offload-params)"""
    lora_rank: int | None = None
    """LoRA: train adapters of this rank (e.g. 16) on --lora-targets, the rest of the model frozen in --param-dtype
    (bfloat16 unless given), with no gradient and no optimizer state; None: every parameter trains"""
    lora_alpha: float | None = None  # with --lora-rank: the adapters' scale is alpha / rank; None: 2 x --lora-rank
    lora_targets: str | None = None
    """with --lora-rank: the projections with adapters, comma-separated, of q,k,v,o,gate,up,down (or peft's q_proj, ...,
    down_proj); None: all seven (q,k,v,o on a mixture of experts)"""
    lora_dropout: float = 0.0  # with --lora-rank: dropout on the adapters' inputs while training (e.g. 0.05)
    fp8: bool = False
    """float8 GEMMs (Hopper) for the q, k, v, o, gate, up and down projections, forward and backward; weights,
    optimizer, norms, attention, loss and unembedding stay as they are (docs/fp8.md); not with experts"""
    fp8_recipe: str = "current"
    """with --fp8, the per-tensor scales: current (each tensor's amax at this step) or delayed (the max of a 16-step
    amax history per tensor, kept in the checkpoints)"""
    optim: OptimConfig = OptimConfig()
    data: Paths = ()  # .txt/.md/.jsonl/.parquet files or directories; none: the Python standard library's sources
    data_field: str = "text"  # the text's field in .jsonl lines and column in .parquet files
    data_format: DataFormat = "text"
    """text: loss on every token; sft: .jsonl {"prompt", "completion"} or {"messages"} records rendered with
    the tokenizer and chat template of the --init-from-hf (or --tokenizer) folder, loss on the answers only"""
    sft_overlong: Literal["refuse", "drop"] = "refuse"
    """with --data-format sft, a record longer than --seq-len (never split across rows): refuse stops before training
    with the count and the longest; drop leaves such records out and says how many at start"""
    eval_data: Paths = ()  # a validation source; none: the documents held out of --data by --eval-fraction
    eval_fraction: float = 0.02  # share of --data documents held out for evaluation (chosen by a hash of the text)
    tokenizer: str | None = None  # a Hugging Face tokenizer.json, or its directory; None: UTF-8 bytes
    eval_every: int = 0  # evaluate every N steps (and at the last step), logged with the training metrics; 0: off
    eval_batches: int = 16  # batches per evaluation during training
    eval_by_position: bool = False  # with --eval-every: also the eval loss in position buckets (eval_loss_pos_*)
    eval_passkey: bool = False  # with --eval-every: also passkey accuracy at --seq-len (eval_passkey_accuracy)
    eval_passkey_samples: int = 2  # with --eval-passkey: samples per depth (0, 0.25, 0.5, 0.75, 1)
    run_dir: str | None = None  # checkpoints, metrics, run.json; None: a new runs/<preset>-<date>-<time>
    config: str | None = None  # a YAML or TOML file of these settings (flags override it)
    resume: bool = False
    """continue the run in --run-dir from its latest complete checkpoint, with its recorded settings (a run stopped
    before its first checkpoint starts again from step 0)"""
    resume_from: int | None = None  # continue from this checkpoint step (later checkpoints are set aside)
    checkpoint_every: int = 50  # steps between checkpoints (and one at the end, and on SIGTERM/SIGINT)
    keep_checkpoints: int = 3  # checkpoints kept (the oldest are deleted)
    seed: int = 0  # parameter init and data order
    wandb_project: str | None = None  # also log to this Weights & Biases project (needs `pip install wandb`)
    profile_steps: str | None = None  # "A:B": write a jax.profiler trace of steps A..B-1 to run_dir/profile
    peak_tflops: float | None = None  # per-device peak for MFU; None: known GPUs' bf16 dense peak
    progress: bool = True  # show a progress bar
    memory_fraction: float | None = None
    """share of each GPU's memory JAX's pool takes (sets XLA_PYTHON_CLIENT_MEM_FRACTION before JAX starts, unless the
    environment sets it: then the environment wins); None: 0.95, what `plan`'s default budget assumes"""
    cpu_devices: int = 8  # fake CPU devices when there is no accelerator
    distributed: bool = False  # multi-host: call jax.distributed.initialize() (cluster settings auto-detected)
    coordinator_address: str | None = None  # multi-host without a cluster manager: "host:port" of process 0
    num_processes: int | None = None  # ... with the number of processes
    process_id: int | None = None  # ... and this process's index
    peer_timeout: float = DEFAULT_PEER_TIMEOUT
    """multi-process: seconds without a heartbeat from another process before every process stops with one line
    naming it (exit 69; restart with --resume)"""


# The settings that are memory tools: ``--memory auto`` chooses them when none is given (``memory_flags_given``).
MEMORY_SETTINGS = ("remat", "remat_every", "remat_nested", "loss_chunk", "mlp_chunk", "attn_chunk", "attn_head_chunk",
                   "delta_head_chunk",
                   "attn_recompute", "attn_keep", "mlp_keep", "param_dtype", "offload_params", "optim.offload",
                   "optim.master_weights")


def memory_flags_given(cfg: TrainConfig, given: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The flags of the ``MEMORY_SETTINGS`` that ``cfg`` has from the user: named in ``given`` (the settings this
    invocation's flags and ``--config`` file give, ``runconfig.given_settings``: ``--no-attn-keep`` counts) or holding
    a value other than the default (from a run's record, or a config built in Python)."""
    changed = memory_changes(TrainConfig(), cfg)
    return [runconfig.flag(path) for path in MEMORY_SETTINGS if path in given or path in changed]


# What ``--memory auto`` may set: the memory tools, and on one GPU the layer loop's unrolling
# (``plan.search.unrollable``), which is not a memory flag (given alone, it does not stop the search)
AUTO_SETTINGS = (*MEMORY_SETTINGS, "scan_unroll")


def memory_changes(before: TrainConfig, after: TrainConfig, settings: tuple[str, ...] = MEMORY_SETTINGS) -> dict:
    """``{setting: value}`` of the ``settings`` that ``after`` sets otherwise than ``before``."""
    a, b = runconfig.to_dict(before), runconfig.to_dict(after)
    return {path: runconfig.get(b, path) for path in settings if runconfig.get(a, path) != runconfig.get(b, path)}


def auto_changes(before: TrainConfig, after: TrainConfig) -> dict:
    """``memory_changes`` over ``AUTO_SETTINGS``: what ``--memory auto`` chose (``train`` records it with why)."""
    return memory_changes(before, after, AUTO_SETTINGS)


# ------------------------------------------------------------------------------------ setup


def _model_config(preset: str, vocab_size: int, **overrides) -> ModelConfig:
    cfg = ModelConfig.from_preset(preset, **{k: v for k, v in overrides.items() if v is not None})
    if vocab_size > cfg.vocab_size:
        if preset != "tiny":
            raise ValueError(
                f"the tokenizer has {vocab_size} tokens but --preset {preset} has a vocabulary of "
                f"{cfg.vocab_size}; pass that model's own tokenizer with --tokenizer"
            )
        cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
    return cfg


PRESET_AND_HF = ("--preset and --init-from-hf exclude each other (the model is the folder's config.json); drop "
                 "--preset")


def compute_settings(cfg: TrainConfig) -> dict:
    """The ``ModelConfig`` fields the flags set: None (not set by any flag, here or in the run) keeps the model's own
    value; a switch (``--attn-recompute``, ``--offload-params``) is always on or off, whatever the model says."""
    return dict(attention_impl=cfg.attention, remat=cfg.remat, remat_every=cfg.remat_every,
                remat_nested=cfg.remat_nested, loss_chunk=cfg.loss_chunk, mlp_chunk=cfg.mlp_chunk,
                attn_chunk=cfg.attn_chunk, attn_head_chunk=cfg.attn_head_chunk, delta_head_chunk=cfg.delta_head_chunk,
                delta_precision=cfg.delta_precision, delta_impl=cfg.delta_impl,
                attn_recompute=cfg.attn_recompute, attn_keep=cfg.attn_keep, attn_max_documents=cfg.attn_max_documents,
                mlp_keep=cfg.mlp_keep, param_dtype=cfg.param_dtype, offload_params=cfg.offload_params,
                scan_unroll=cfg.scan_unroll, moe_impl=cfg.moe_impl, fp8=cfg.fp8, fp8_recipe=cfg.fp8_recipe)


def recorded_model(record: dict) -> ModelConfig:
    """The model a run was started from, before its flags: the record's model with every field a flag sets at its
    default (what ``--init-from-hf``'s config.json gave, read again from the record, not from the folder)."""
    defaults = ModelConfig()
    fields = {**record["model"], **record.get("compute", {})}
    fields.update({k: getattr(defaults, k) for k in compute_settings(TrainConfig())})
    return model_config_from_run({"model": fields})


def model_config(cfg: TrainConfig, vocab_size: int, *, record: dict | None = None) -> ModelConfig:
    """``_model_config_of`` with ``--router-aux-loss-coef`` over the model's own weight (a learned setting: the run
    records the weight it trains with, and a resume keeps it unless the flag is given again)."""
    model = with_lora(cfg, _model_config_of(cfg, vocab_size, record=record), record=record)
    if cfg.router_aux_loss_coef is None:
        return model
    if not model.num_experts:
        raise ValueError(f"--router-aux-loss-coef ({cfg.router_aux_loss_coef}) weighs the experts' load-balancing "
                         f"loss, but {model.name} has no experts; drop the flag")
    return dataclasses.replace(model, router_aux_loss_coef=cfg.router_aux_loss_coef)


def lora_settings(cfg: TrainConfig, model: ModelConfig) -> dict:
    """``{flag field: (value, why)}`` of the LoRA settings ``cfg`` leaves at None, as ``with_lora`` fills them in."""
    if cfg.lora_rank is None:
        return {}
    out = {}
    if cfg.lora_alpha is None:
        out["lora_alpha"] = (2.0 * cfg.lora_rank, "2 x --lora-rank")
    if cfg.lora_targets is None:
        targets = default_targets(model)
        why = "attention only: LoRA on experts is not supported" if model.num_experts else (
            "the attention and MLP projections")
        out["lora_targets"] = (",".join(targets), why + (", and the delta-net's" if model.linear_layers else ""))
    if cfg.param_dtype is None:
        out["param_dtype"] = ("bfloat16", "the frozen base in bfloat16 with --lora-rank")
    return out


def with_lora(cfg: TrainConfig, model: ModelConfig, record: dict | None = None) -> ModelConfig:
    """``model`` with the adapters of ``--lora-rank`` (``ModelConfig.lora``), or without any; ``ValueError`` naming the
    flag on a bad value (a rank below 1, a target the model does not have). ``record``: the run being resumed."""
    recorded_rank = ((record or {}).get("config") or {}).get("lora_rank")
    if cfg.lora_rank is None and recorded_rank is not None:
        raise ValueError(f"--lora-rank None: this run trains LoRA adapters of rank {recorded_rank}, which a resumed "
                         f"run keeps; drop --lora-rank None (or start a new --run-dir without adapters)")
    if cfg.lora_rank is None:
        qualifiers = [f for f in ("lora_alpha", "lora_targets") if getattr(cfg, f) is not None]
        if qualifiers or cfg.lora_dropout:
            flag = runconfig.flag(qualifiers[0] if qualifiers else "lora_dropout")
            raise ValueError(f"{flag} qualifies LoRA adapters, but --lora-rank is not set; add --lora-rank R (e.g. 16) "
                             f"or drop {flag}")
        return dataclasses.replace(model, lora=None)
    if model.offload_params:
        raise ValueError("--offload-params with --lora-rank is not supported: the frozen base stays on the devices "
                         "(in bfloat16 by default); drop --offload-params")
    given = {k: v for k, (v, _) in lora_settings(cfg, model).items()}
    lora = LoraConfig(rank=cfg.lora_rank, alpha=cfg.lora_alpha if cfg.lora_alpha is not None else given["lora_alpha"],
                      targets=cfg.lora_targets or given["lora_targets"], dropout=cfg.lora_dropout)
    lora.check(model)
    return dataclasses.replace(model, lora=lora, param_dtype=given.get("param_dtype", model.param_dtype))


def _model_config_of(cfg: TrainConfig, vocab_size: int, *, record: dict | None = None) -> ModelConfig:
    """The model a ``TrainConfig`` trains: its preset, or ``--init-from-hf``'s config.json (no weight is read), with
    the memory tools and attention of the flags. ``vocab_size``: the tokenizer's (0: no tokenizer to check).

    ``record``: the run being resumed; a run started from a Hugging Face folder takes its model from the record (the
    folder's config.json is not read again). Presets and folders get the flags the same way: ``cfg`` holds the run's
    settings with this invocation's flags over them (``cli.parse``), so a flag given when the run started still holds,
    and one given now (``--no-attn-recompute``, ``--attn-chunk 0``) replaces it.
    """
    # the window shapes the model (a LEARNED model field, kept on resume), so it is no compute setting to reset
    compute = {**compute_settings(cfg), "sliding_window": cfg.sliding_window}
    if cfg.attn_head_chunk and not cfg.attn_chunk:
        raise ValueError(f"--attn-head-chunk ({cfg.attn_head_chunk}) groups the heads of the tiled attention "
                         f"sublayer; add --attn-chunk (tokens per chunk of each device's sequence, e.g. 4096)")
    if cfg.attn_recompute and not cfg.attn_chunk:
        raise ValueError("--attn-recompute recomputes the output of the tiled attention sublayer; add --attn-chunk "
                         "(tokens per chunk of each device's sequence, e.g. 4096)")
    if cfg.fp8_recipe != "current" and not cfg.fp8:
        raise ValueError(f"--fp8-recipe {cfg.fp8_recipe} chooses the scales of float8 GEMMs, but --fp8 is not set; add "
                         f"--fp8 or drop --fp8-recipe")
    if cfg.init_from_hf is None:
        return _model_config(cfg.preset or "tiny", vocab_size, **compute)
    if cfg.preset not in (None, "tiny"):  # "tiny" is the default; the CLI refuses an explicit one (cli.parse)
        raise ValueError(PRESET_AND_HF)
    overrides = {k: v for k, v in compute.items() if v is not None}
    if record is not None and record.get("init_from_hf"):
        model = dataclasses.replace(recorded_model(record), **overrides)
        what = "the run's model"
    else:
        model = ModelConfig.from_hf(cfg.init_from_hf, **overrides)
        what = f"--init-from-hf {cfg.init_from_hf}"
    if vocab_size > model.vocab_size:
        fix = ("resume with the run's tokenizer (leave out --tokenizer)" if record is not None else
               "use the folder's own tokenizer (leave out --tokenizer)")
        raise ValueError(f"the tokenizer has {vocab_size} tokens but {what} has a vocabulary of {model.vocab_size}; "
                         f"{fix}")
    return model


def model_config_from_run(record: dict, **compute) -> ModelConfig:
    """The run's model, with its compute settings unless ``compute`` (attention_impl, remat, ...) gives others."""
    fields = {**record["model"], **record.get("compute", {}), **{k: v for k, v in compute.items() if v is not None}}
    # a tool switched off (--attn-chunk 0, --remat none or full) takes the options the run gave it along, as on resume
    defaults = ModelConfig()
    off = runconfig.switched_off(compute, {k for k, v in compute.items() if v is not None})
    fields.update({k: getattr(defaults, k) for k in off if k in fields})
    if fields.get("rope_scaling"):
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    try:
        return ModelConfig(**fields)
    except TypeError as e:
        raise ValueError(f"run.json's model is not one this version of ulysses-jax knows ({e}); use the version that "
                         f"wrote the run") from None


def check_eval_flags(cfg: TrainConfig) -> None:
    """``ValueError`` in one line where an evaluation setting is given without the evaluation it qualifies (it would
    do nothing): ``--eval-batches``, ``--eval-by-position`` and ``--eval-passkey`` need ``--eval-every``,
    ``--eval-passkey-samples`` needs ``--eval-passkey``."""
    default = TrainConfig()
    given = [f for f in ("eval_batches", "eval_by_position", "eval_passkey", "eval_passkey_samples")
             if getattr(cfg, f) != getattr(default, f)]
    if given and not cfg.eval_every:
        flag = runconfig.flag(given[0])
        raise ValueError(f"{flag} qualifies the evaluation during training, but --eval-every is 0 (off); add "
                         f"--eval-every N (steps) or drop {flag} (after training: ulysses-jax eval --run-dir ...)")
    if "eval_passkey_samples" in given and not cfg.eval_passkey:
        raise ValueError(f"--eval-passkey-samples ({cfg.eval_passkey_samples}) sets the passkey evaluation's samples, "
                         f"but --eval-passkey is not set; add --eval-passkey or drop --eval-passkey-samples")


def data_config(cfg: TrainConfig) -> DataConfig:
    check_eval_flags(cfg)
    return DataConfig(paths=tuple(cfg.data), tokenizer=cfg.tokenizer, text_field=cfg.data_field,
                      eval_fraction=cfg.eval_fraction, eval_paths=tuple(cfg.eval_data), format=cfg.data_format,
                      frame=cfg.init_from_hf is not None, sft_overlong=cfg.sft_overlong)


def default_run_dir(preset: str) -> str:
    return f"runs/{preset}-{time.strftime('%Y%m%d-%H%M%S')}"
