"""LoRA adapters out, in the format the peft library loads, and merged into their base (``model/lora.py``).

A peft adapter folder holds ``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``, ``target_modules``,
``base_model_name_or_path``, ...) and ``adapter_model.safetensors``, whose tensors are named after the base model's
modules under ``base_model.model.`` (the ``PeftModel`` wrapper, then the ``...ForCausalLM``), without the adapter's own
name: ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ``[r, in]`` and ``... .lora_B.weight``
``[out, r]``, so that the layer computes ``W x + (lora_alpha / r) B (A x)``. The module names are the tensor names of
the model's family (``interop/hf.py: entries``, the targeted weight's name without ``.weight``), so every family
exports the same way.

Ours: ``A [L, in..., r]``, ``B [L, r, out...]`` with ``W [L, in..., out...]`` (``W + scale A B``): per layer, peft's
``lora_A`` is ``A`` flattened to ``[in, r]`` and transposed, ``lora_B`` is ``B`` flattened to ``[r, out]`` and
transposed, the flattened dimensions in the order of the HF tensor's letters (``NH`` for q, ``N`` major).

``merge_into_folder`` writes the base folder the run started from (``--init-from-hf``) with the adapters merged in:
each targeted tensor ``W + (alpha / r) B A`` summed in float32 from the folder's own ``W`` and rounded once, to the
folder's dtype or ``--dtype``; every other tensor byte for byte (what ``export --merge`` writes). ``merged`` gives the
model without adapters whose targeted weights are ``W + scale A B`` from the run's own copy of the base: what a run
whose base is a preset's initialisation merges (it has no folder).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ulysses_jax.interop import hf
from ulysses_jax.model import fp8_base, lora
from ulysses_jax.model.lora_config import HF_NAMES

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the ...ForCausalLM


def _entry(cfg, target: str, hint=None):
    """The tensor row of ``target``'s (first) weight in the family that writes ``cfg``."""
    module, attr, _ = lora.WEIGHTS[target]
    param = f"blocks.{module}.{attr if isinstance(attr, str) else attr[0]}"
    return next(e for e in hf.entries(cfg, hint) if e.param == param)


def module_name(cfg, target: str, layer: int, hint=None) -> str:
    """The Hugging Face module of ``target`` in ``layer`` (``model.layers.3.self_attn.q_proj``)."""
    entry = _entry(cfg, target, hint)
    name = hf.tensor_name(entry, layer).removesuffix(".weight")
    if entry.fused is not None and (entry.fused.groups or not name.endswith(target)):
        raise ValueError(f"--lora-targets {target}: the family that writes {cfg.name} fuses that projection with "
                         f"others per head ({name}), whose adapter peft would need in another row order; adapters of "
                         f"the delta-net are written for Qwen3.5's layout only: drop {target} from --lora-targets")
    return name


def adapter_config(cfg, base_model: str | None) -> dict:
    """``adapter_config.json`` of a model's adapters (the fields peft reads; the rest take peft's defaults)."""
    alpha = cfg.lora.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "revision": None,
        "r": cfg.lora.rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": cfg.lora.dropout,
        "target_modules": [HF_NAMES[t] for t in cfg.lora.targets],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def adapter_tensors(model, dtype: str = "float32") -> dict[str, np.ndarray]:
    """peft's tensors (module doc) of ``model``'s adapters, by name. Every process must call it (the gathers are
    collectives)."""
    cfg, r = model.config, model.config.lora.rank
    out = {}
    for t in cfg.lora.targets:
        a = hf._fetch(getattr(model.blocks.lora, f"w_{t}_a").get_value())  # [L, in..., r]
        b = hf._fetch(getattr(model.blocks.lora, f"w_{t}_b").get_value())  # [L, r, out...]
        rows = cfg.stacked_layers(lora.WEIGHTS[t][0])  # a hybrid's mixers: stacked over their own layers
        for i in lora.target_layers(cfg, t):  # a hybrid's attention or delta-net layers
            name, row = PREFIX + module_name(cfg, t, i), rows.index(i)
            out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[row].reshape(-1, r).T.astype(jnp.dtype(dtype)))
            out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[row].reshape(r, -1).T.astype(jnp.dtype(dtype)))
    return out


def write_adapter(model, path, *, base_model: str | None, tokenizer_from=None, dtype: str | None = None) -> list[str]:
    """Write ``model``'s adapters as a peft adapter folder ``path`` (new or empty); ``tokenizer_from``: a Hugging Face
    folder whose tokenizer files go along. Returns the files written (process 0 writes)."""
    from safetensors.numpy import save_file

    out = pathlib.Path(path).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} is not an empty folder; export into a new or empty folder")
    tensors = adapter_tensors(model, dtype or "float32")
    if jax.process_index() != 0:
        return []
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = adapter_config(model.config, base_model)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    source = None if tokenizer_from is None else pathlib.Path(tokenizer_from)
    for name in hf.TOKENIZER_FILES if source is not None else ():
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    return sorted(p.name for p in out.iterdir())


def merged(model):
    """``model`` without adapters, each targeted weight ``W + scale A B`` (summed in float32, rounded once to ``W``'s
    dtype, in ``W``'s sharding); the other parameters are the same arrays."""
    from ulysses_jax.model.transformer import Transformer

    cfg = model.config
    base_cfg = dataclasses.replace(cfg, lora=None)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(base_cfg, mesh=model.mesh, rngs=nnx.Rngs(0))))
    _, state = lora.split(nnx.state(model, nnx.Param))
    state = jax.tree.map(lambda x: x, state)  # new variables: the model's own are not changed
    state = fp8_base.thawed(state, cfg)  # --fp8: the base as every step computed with it (dequantised)
    for t in cfg.lora.targets:
        module, attrs, n_in = lora.WEIGHTS[t]
        attrs = (attrs,) if isinstance(attrs, str) else attrs
        a = getattr(model.blocks.lora, f"w_{t}_a").get_value()
        b = getattr(model.blocks.lora, f"w_{t}_b").get_value()
        variables = [state["blocks"][module][x] for x in attrs]
        outs = [v.get_value().shape[1 + n_in:] for v in variables]
        for k, var in enumerate(variables):  # a fused target: each weight its share of B's outputs
            w = var.get_value()

            def add(w, a, b, k=k, n_in=n_in):
                d = lora.delta(a, b, n_in, cfg.lora.scale)
                return (w.astype(jnp.float32) + (d if len(outs) == 1 else lora.split_fused(d, outs)[k])).astype(w.dtype)

            var.set_value(jax.jit(add, out_shardings=w.sharding)(w, a, b))
    return nnx.merge(graphdef, state)


def merged_config(config: dict, dtype: str | None, max_position: int | None) -> dict:
    """The base folder's ``config.json`` for the merged folder: ``dtype`` and a longer ``max_position_embeddings``.
    A YaRN scaling that leaves out its ``original_max_position_embeddings`` has it pinned to the folder's own length
    first: transformers derives it from ``max_position_embeddings``, which would move the RoPE the model learned."""
    config = json.loads(json.dumps(config))
    if dtype is not None:
        config.update({k: dtype for k in ("torch_dtype", "dtype") if k in config} or {"torch_dtype": dtype})
    old = config.get("max_position_embeddings", 0)
    if max_position and max_position > old:
        for key in ("rope_scaling", "rope_parameters"):
            params = config.get(key)
            nested = isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values())
            for p in (params.values() if nested else [params]):  # Gemma 3's: one per layer type
                yarn = isinstance(p, dict) and p.get("rope_type", p.get("type")) == "yarn"
                if yarn and not p.get("original_max_position_embeddings") and old:
                    p["original_max_position_embeddings"] = old
        config["max_position_embeddings"] = max_position
    return config


def merge_into_folder(model, base, path, *, dtype: str | None = None, max_position: int | None = None) -> list[str]:
    """Write the Hugging Face folder ``base`` into ``path`` (new or empty) with ``model``'s adapters merged into its
    targeted tensors (module doc); ``dtype``: the floating tensors' dtype in the files (None: each tensor's own);
    ``max_position``: a longer ``max_position_embeddings`` for config.json (the run trained past the folder's). Every
    process must call it (the adapters are gathered); process 0 reads the base, one shard at a time, and writes."""
    from safetensors.numpy import save_file

    cfg, base, out = model.config, pathlib.Path(base), pathlib.Path(path).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} is not an empty folder; export into a new or empty folder")
    adapters = adapter_tensors(model, "float32")
    if jax.process_index() != 0:
        return []
    folder = hf.SafetensorsFolder(base)
    deltas = {}  # the targeted tensor's name -> (A [r, in], B [out, r])
    for name in adapters:
        if name.endswith(".lora_A.weight"):
            module = name.removeprefix(PREFIX).removesuffix(".lora_A.weight")
            deltas[module + ".weight"] = (adapters[name], adapters[name.replace(".lora_A.", ".lora_B.")])
    missing = sorted(set(deltas) - set(folder.tensors))
    if missing:
        raise ValueError(f"{base} has no tensor {missing[0]} for the adapters to merge into; pass the folder the run "
                         f"started from")
    out.mkdir(parents=True, exist_ok=True)
    by_file: dict[str, list[str]] = {}
    for name, (file, _, _) in folder.tensors.items():
        by_file.setdefault(file, []).append(name)
    sizes = {}
    for file, names in sorted(by_file.items()):
        tensors = {}
        for name in names:
            x = folder.read(name, tuple(slice(None) for _ in folder.tensors[name][1]))
            floating = jnp.issubdtype(x.dtype, jnp.floating)
            if name in deltas:
                a, b = deltas[name]
                x = (x.astype(np.float32) + np.float32(cfg.lora.scale) * (b @ a)).astype(jnp.dtype(dtype or x.dtype))
            elif dtype is not None and floating:
                x = x.astype(jnp.dtype(dtype))
            tensors[name] = np.ascontiguousarray(x)
            sizes[name] = tensors[name].nbytes
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors
        folder.release()
    index = base / "model.safetensors.index.json"
    if index.is_file():
        raw = hf.read_json(index)
        raw["metadata"] = {**(raw.get("metadata") or {}), "total_size": sum(sizes.values())}
        (out / index.name).write_text(json.dumps(raw, indent=2) + "\n")
    config = merged_config(hf.read_json(base / "config.json"), dtype, max_position)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("generation_config.json", *hf.TOKENIZER_FILES):
        if (base / name).is_file():
            shutil.copyfile(base / name, out / name)
    return sorted(p.name for p in out.iterdir())
