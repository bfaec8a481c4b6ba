"""The peer's training step for `bench_peers.py` (its module doc says what the peers are): transformers' model of
the same shapes as one of our presets, built from our own config.json writer, with peft's LoRA and Liger Kernel where
the row asks, timed on the same tokens as ours. Imported only in the peer's child process: torch, transformers, peft
and liger-kernel never enter the package or our child."""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
CLIP_NORM = 1.0  # ours: OptimConfig().clip_norm, the default of bench_train's step
NO_CHECKPOINTING = "no-checkpointing"  # a peer's variant (``transformers+liger/no-checkpointing``): no recompute


def _hf_config(preset: str):
    """transformers' config of one of our presets, through our own config.json writer (the same shapes)."""
    import transformers

    from ulysses_jax.model.config import ModelConfig
    from ulysses_jax.model.hf_config import export_architecture, hf_config

    cfg = ModelConfig.from_preset(preset)
    raw = hf_config(cfg, export_architecture(cfg), "float32")
    kind = transformers.CONFIG_MAPPING[raw.pop("model_type")]
    return kind(**{k: v for k, v in raw.items() if k != "architectures"}), raw["architectures"][0]


def _lora_targets(preset: str) -> list[str]:
    """peft's module names of the projections ours adapts on ``preset`` (``lora_config.default_targets``, train's)."""
    from ulysses_jax.model.config import ModelConfig
    from ulysses_jax.model.lora_config import HF_NAMES, default_targets

    return [HF_NAMES[t] for t in default_targets(ModelConfig.from_preset(preset))]


def peer(spec: dict) -> dict:
    """The peer's step (module doc): the same tokens as ours (bench_train's random batch: one document a row, or
    packed rows with the same cuts, given to the peer as position ids that restart at each document)."""
    import numpy as np

    from ulysses_jax.model.config import ModelConfig

    if ModelConfig.from_preset(spec["preset"]).linear_layers:
        # a hybrid: transformers takes flash-linear-attention's kernels wherever fla imports, and fla 0.6.0's
        # backward fails on Hopper with Triton 3.6 (the H100 of 2026-11-27): the peer runs transformers' own
        # chunked delta rule (torch), as users without fla do; the note names it (_delta_kernel)
        sys.modules.setdefault("fla", None)
    import torch
    import transformers

    sys.path.insert(0, str(HERE))
    from bench_train import random_batch

    cuda = torch.cuda.is_available()
    if not cuda and not spec.get("allow_cpu"):
        raise RuntimeError("no CUDA device for the peer")
    device = "cuda" if cuda else "cpu"
    config, arch = _hf_config(spec["preset"])
    name, _, variant = spec["peer"].partition("/")  # "/no-checkpointing": the peer keeps its activations
    if name == "transformers+liger":
        import liger_kernel.transformers as liger  # noqa: F401 - raises where it is not installed

        family = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2",
                  "MistralForCausalLM": "mistral", "Qwen3_5ForCausalLM": "qwen3_5",
                  "Qwen3NextForCausalLM": "qwen3_next"}.get(arch, arch)
        patch = getattr(liger, f"apply_liger_kernel_to_{family}", None)
        if patch is None:
            raise RuntimeError(f"liger-kernel has no apply_liger_kernel_to_{family} for {arch}")
        patch()
    lora = spec["mode"] == "lora16"
    packed = spec["documents"] > 1
    # flex attention has no backward on a CPU (torch 2.13): the CPU dry run takes SDPA with the dense packed mask
    config._attn_implementation = "flex_attention" if packed and cuda else "sdpa"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16 if lora else
                                                              torch.float32)
    if variant != NO_CHECKPOINTING:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=_lora_targets(spec["preset"])))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=cuda)
    batch = random_batch(1, spec["seq_len"], config.vocab_size, documents=spec["documents"])
    ids = torch.as_tensor(batch["tokens"].astype(np.int64), device=device)
    extra = {}
    if packed:  # each document's positions from 0: transformers' packed-sequence mask (masking_utils)
        seg = batch["segment_ids"]
        starts = np.concatenate([np.ones((seg.shape[0], 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
        idx = np.broadcast_to(np.arange(seg.shape[1]), seg.shape)
        pos = idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
        extra["position_ids"] = torch.as_tensor(pos.astype(np.int64), device=device)
    def step() -> float:
        # bf16 autocast in both modes, as the Trainer runs with bf16=True: with LoRA, peft keeps the adapters in
        # float32 (its autocast_adapter_dtype), and without autocast their GEMMs ran in float32 on float32 copies of
        # the inputs, work ours does not do (the LoRA peer rows through 2026-11-28 ran so)
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            # transformers shifts the labels itself: the tokens as labels, as its users pass them (ours' targets)
            out = model(input_ids=ids, labels=ids, **extra)
        out.loss.backward()
        # the global norm clipped at 1, as ours does (OptimConfig's clip_norm) and the Trainer (its max_grad_norm)
        torch.nn.utils.clip_grad_norm_(params, CLIP_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return float(out.loss)

    times, loss = [], None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(spec["warmup"] + spec["steps"]):
        t0 = time.perf_counter()
        loss = step()
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    out = {"step_s": statistics.median(times), "peak_gib": peak, "loss": loss}
    if spec.get("profile") and cuda:  # one more step, after the timed ones, under torch's profiler
        try:
            out["attention"] = attention_kernels(_kernel_times(step))
        except Exception as e:  # noqa: BLE001 - a diagnostic: the measurement above stands without it
            out["attention"] = f"peer's attention kernels: not profiled ({type(e).__name__}: {str(e)[:80]})"
    kernel = _delta_kernel(model)
    if kernel:
        out["kernel"] = kernel
    return out


ATTENTION_KERNELS = ("flash", "fmha", "sdpa", "attention", "attn")  # in the names of SDPA's kernels, any backend


def _kernel_times(step) -> dict[str, float]:
    """Milliseconds of device time per kernel name over one ``step()`` under torch's profiler (CUDA)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)  # torch renamed it
        if us:
            out[e.key] = out.get(e.key, 0.0) + us / 1e3
    return out


def attention_kernels(times: dict[str, float]) -> str:
    """The row's note on the peer's attention: which kernels ran (cuDNN's, FlashAttention's, memory-efficient) and
    their device time in one step, beside the step's whole device time: is the gap to ours attention or the rest?"""
    att = {k: v for k, v in times.items() if any(t in k.lower() for t in ATTENTION_KERNELS)}
    top = sorted(att.items(), key=lambda kv: -kv[1])[:3]
    named = "; ".join(f"{k[:70]} {v:.1f} ms" for k, v in top) or "none matched"
    return (f"peer's attention kernels {sum(att.values()):.1f} of {sum(times.values()):.1f} ms device time in a "
            f"profiled step: {named}")


def _delta_kernel(model) -> str | None:
    """Which delta rule the peer's hybrid ran, for the row's note (None without delta-net layers): the layer's own
    ``chunk_gated_delta_rule`` where transformers keeps one (its 5.17 and earlier), else the modeling module's
    ``torch_chunk_gated_delta_rule`` and the implementation its kernel-hub wrapper chose (fla's kernel where fla
    imports, its torch loop where not); and whether flash-linear-attention imports in this process at all."""
    import importlib.util

    layer = next((m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    if layer is None:
        return None
    fn = getattr(layer, "chunk_gated_delta_rule", None) or getattr(
        sys.modules.get(type(layer).__module__), "torch_chunk_gated_delta_rule", None)
    code = getattr(fn, "__code__", None)
    if code is not None and fn.__closure__:  # the wrapper keeps its choice in a closure cell named "implementation"
        fn = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__))).get("implementation", fn)
    where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', '?')}" if fn is not None else "not found"
    if "fla" in sys.modules and sys.modules["fla"] is None:
        state = "kept out (its backward fails on Hopper with Triton 3.6)"
    else:
        state = "imports" if importlib.util.find_spec("fla") is not None else "not installed"
    return f"peer's delta rule: {where}; flash-linear-attention {state}"
