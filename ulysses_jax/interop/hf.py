"""Hugging Face model folders in and out: ``*.safetensors`` weights, with ``config.json`` (``model/hf_config.py``) and
the tokenizer files (``data/tokenizers.py``) beside them.

Each model family (``model/families/``) names its tensors both ways in its ``ENTRIES``: our parameter (a path in the
NNX model, its dimension letters) and the Hugging Face tensor (its name, its dimension letters, ``"NH,D"`` meaning a
``[N*H, D]`` matrix). Import reshapes and transposes HF -> ours with the rows of the model's family, export ours ->
HF; nothing else knows a tensor name. For example (the Llama layout):

  ours                              HF
  embed_VD [V, D]                   model.embed_tokens.weight [V, D]
  blocks.attn.wq_DNH [L, D, N, H]   model.layers.{i}.self_attn.q_proj.weight [N*H, D]   (one per layer)
  blocks.attn.wo_NHD [L, N, H, D]   model.layers.{i}.self_attn.o_proj.weight [D, N*H]
  blocks.mlp.w_gate_DF [L, D, F]    model.layers.{i}.mlp.gate_proj.weight [F, D]   ... (see model/families/tensors.py)

Our layers are stacked on a leading axis (the scanned block), HF's are numbered; RoPE is the same half-split
rotation in both, so no permutation of q/k rows is needed.

Import (``from_hf``) never holds a whole model on the host: each parameter is assembled per device from the
slices that device holds (safetensors slicing: ``get_slice(name)[rows, cols]`` reads only those bytes of the
memory-mapped file), one parameter and one device block at a time, converted to ``param_dtype`` on the way,
and placed with ``jax.make_array_from_single_device_arrays``; each process reads only its own devices' blocks.
Every tensor's presence, shape and dtype are checked from the file headers before anything is read.

Export (``to_hf``) gathers one HF tensor (one layer's slice) at a time; every process takes part in the gather,
process 0 alone writes. Shards hold at most ``max_shard_bytes`` (5 GB, as ``save_pretrained``), so that is the
most host memory an export needs beyond one tensor. ``config.json`` is written in the layout of the published
Llama 3.x folders (``rope_theta`` + ``rope_scaling``), which transformers 4 reads and 5 converts.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from ulysses_jax.interop import mxfp4
from ulysses_jax.model import fp8
from ulysses_jax.model.config import ModelConfig
from ulysses_jax.model.families.tensors import Entry, assemble
from ulysses_jax.model.hf_config import HF_CONFIG_FIELDS, export_architecture, export_family, hf_config, read_json
from ulysses_jax.model.transformer import Transformer
from ulysses_jax.parallel.sharding import param_shardings

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # the dtypes (safetensors names) that weights may have
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default "5GB"
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers that old checkpoints carry; recomputed, never read


def entries(cfg: ModelConfig, hint=None) -> list[Entry]:
    """The tensor rows of the family that writes ``cfg`` (``hint``: the source folder's ``architectures``) that a model
    with ``cfg`` has; ``ValueError`` for a model that no Hugging Face architecture here holds."""
    return [e for e in export_family(cfg, hint).ENTRIES if e.applies(cfg)]


def letter_sizes(cfg: ModelConfig) -> dict[str, int]:
    """Each letter of the families' tensor rows (``model/families/tensors.py``) -> its size in ``cfg``: the delta-net's
    ``J`` key and ``U`` value heads, ``Q`` / ``W`` their dims, ``M`` value heads per key head, ``C`` filter taps;
    ``Y`` a gated q projection's ``2 H`` per head, ``Z`` a shared expert's width, ``O`` = 1."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    return dict(V=cfg.vocab_size, D=cfg.hidden, N=cfg.num_heads, K=cfg.num_kv_heads, H=cfg.head_dim, F=cfg.mlp_dim,
                E=cfg.num_experts, G=cfg.expert_mlp_dim, X=2 * cfg.expert_mlp_dim, J=hk, U=hv,
                Q=cfg.linear_key_head_dim, W=cfg.linear_value_head_dim, M=hv // hk if hk else 0,
                C=cfg.linear_conv_kernel, Y=2 * cfg.head_dim, Z=cfg.shared_expert_dim, O=1)


def tensor_name(entry: Entry, layer: int | None = None, expert: int | None = None) -> str:
    return entry.hf.format(i=layer, j=expert) if entry.stacked else entry.hf


def hf_names(entry: Entry, cfg: ModelConfig) -> list[str]:
    if not entry.stacked:
        return [entry.hf]
    experts = range(cfg.num_experts) if entry.experts else [None]
    return [tensor_name(entry, i, j) for i in entry.layers(cfg) for j in experts]


# ----------------------------------------------------------------------------------------------
# safetensors in


class SafetensorsFolder:
    """The tensors of a folder: ``model.safetensors``, or the shards that ``model.safetensors.index.json`` lists.

    ``tensors`` maps each name to ``(file, shape, dtype)`` read from the headers; ``read`` cuts one slice of one
    tensor out of its memory-mapped file. Files stay open until ``release()``.
    """

    def __init__(self, path):
        import safetensors  # noqa: F401  (fail here, with the package's own message, if it is missing)

        self.folder = folder = pathlib.Path(path).expanduser()
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index} has no weight_map; restore the file from the model's source")
            files = sorted(set(weight_map.values()))
        elif (folder / "model.safetensors").is_file():
            weight_map, files = None, ["model.safetensors"]
        else:
            raise ValueError(f"{folder} has neither model.safetensors nor model.safetensors.index.json; "
                             f"pass a Hugging Face model folder with safetensors weights")
        for f in files:
            if not (folder / f).is_file():
                raise ValueError(f"{index} lists shard {f}, which is missing from {folder}; copy the whole folder")
        self._open, self.tensors, self.mxfp4 = {}, {}, set()
        for f in files:
            handle = self._handle(f)
            for name in handle.keys():
                sl = handle.get_slice(name)
                if name in self.tensors:
                    raise ValueError(f"tensor {name} is in both {self.tensors[name][0]} and {f}; remove one copy")
                self.tensors[name] = (f, tuple(sl.get_shape()), sl.get_dtype())
        self.release()
        for name, f in (weight_map or {}).items():
            if self.tensors.get(name, (f,))[0] != f:
                raise ValueError(f"{index} places tensor {name} in {f}, which does not hold it; restore the index")

    def _handle(self, file: str):
        from safetensors import safe_open

        if file not in self._open:
            # framework="flax": NumPy cannot name bfloat16; arrays are made on this process's CPU, then viewed.
            try:
                self._open[file] = safe_open(str(self.folder / file), framework="flax").__enter__()
            except Exception as e:  # safetensors raises its own error type for a damaged header
                raise ValueError(f"{self.folder / file} is not a readable safetensors file ({e}); "
                                 f"copy it again from the model's source") from None
        return self._open[file]

    def nbytes(self, name: str) -> int:
        """The bytes of tensor ``name`` (from its header)."""
        _, shape, dtype = self.tensors[name]
        return math.prod(shape) * {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}.get(dtype, 4)

    def release(self) -> None:
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        if name in self.mxfp4:  # the experts of index[0], dequantised whole (interop/mxfp4.py), then cut
            blocks, scales = (self.read(name + suffix, index[:1]) for suffix in mxfp4.SUFFIXES)
            return mxfp4.dequantize(blocks, scales)[(slice(None), *index[1:])]
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            return np.asarray(self._handle(self.tensors[name][0]).get_slice(name)[index])

    def check(self, cfg: ModelConfig, hint=None) -> None:
        """Every tensor ``cfg`` needs is here with its shape and a floating dtype, and nothing else is but what the
        family leaves unread (``IGNORED_PREFIXES``). ``hint``: the folder's ``architectures``."""
        sizes, expected = letter_sizes(cfg), {}
        ignored = getattr(export_family(cfg, hint), "IGNORED_PREFIXES", ())
        for entry in entries(cfg, hint):
            for name in hf_names(entry, cfg):
                expected[name] = entry.tensor_shape(sizes)
        for name, shape in expected.items():
            if name not in self.tensors and all(name + x in self.tensors for x in mxfp4.SUFFIXES):
                mxfp4.check_shapes(self.tensors, name, shape)
                self.mxfp4.add(name)
                continue
            if name not in self.tensors:
                raise ValueError(f"tensor {name} is missing from {self.folder}; the weights do not match config.json")
            file, have, dtype = self.tensors[name]
            if have != shape:
                raise ValueError(f"tensor {name} in {file} has shape {list(have)}, but config.json implies "
                                 f"{list(shape)}; the weights do not match config.json")
            if dtype not in FLOAT_DTYPES:
                raise ValueError(f"tensor {name} in {file} has dtype {dtype}; weights must be one of "
                                 f"{', '.join(FLOAT_DTYPES)}")
        tied_head = {"lm_head.weight"} if cfg.tie_embeddings else set()  # a tied model may still carry its copy
        quantized = {n + x for n in self.mxfp4 for x in mxfp4.SUFFIXES}
        for name, (file, _, _) in self.tensors.items():
            known = name in expected or name in quantized or name in tied_head or name.startswith(ignored)
            if not known and not name.endswith(_IGNORED_SUFFIXES):
                raise ValueError(
                    f"tensor {name} in {file} is unexpected for this config.json ({cfg.num_layers} layers, qkv_bias="
                    f"{cfg.qkv_bias}, qk_norm={cfg.qk_norm}, tied={cfg.tie_embeddings}); the weights do not match it")


def _read_layer(folder: SafetensorsFolder, name: str, entry: Entry, sizes, cut: tuple[slice, ...]) -> np.ndarray:
    """Our ``[...]``-layout block ``cut`` of one HF tensor, reading only the rows/columns it needs (the whole tensor for
    a piece of a fused one)."""
    by_letter = dict(zip(entry.dims, cut))
    if entry.fused is not None:
        x = entry.to_ours(entry.piece(folder.read(name, (slice(None),)), sizes), sizes)
        return x[tuple(by_letter[c] for c in entry.dims)]
    groups = entry.hf_dims.split(",")
    x = entry.to_ours(folder.read(name, tuple(by_letter.get(g, slice(None)) if len(g) == 1 else slice(None)
                                              for g in groups)), sizes)
    return x[tuple(slice(None) if c in groups else by_letter[c] for c in entry.dims)]  # cut merged dims now


def _read_block(folder, entry: Entry, cfg: ModelConfig, cut: tuple[slice, ...], dtype) -> np.ndarray:
    """One device's block of a parameter (``cut``: a slice per dimension), in ``dtype``."""
    sizes = letter_sizes(cfg)
    if not entry.stacked:
        return np.ascontiguousarray(_read_layer(folder, entry.hf, entry, sizes, cut), dtype)
    layers, cut = entry.layers(cfg)[cut[0].start:cut[0].stop], cut[1:]  # the layer of each row of the block
    out = np.empty((len(layers), *(s.stop - s.start for s in cut)), dtype)
    for n, i in enumerate(layers):
        if entry.experts:  # one HF tensor per expert of the block's E range
            for m, j in enumerate(range(cut[0].start, cut[0].stop)):
                out[n, m] = _read_layer(folder, tensor_name(entry, i, j), entry.per_tensor, sizes, cut[1:])
        else:
            out[n] = _read_layer(folder, tensor_name(entry, i), entry, sizes, cut)  # converts the dtype
    return out


def _load_param(folder, entry: Entry, cfg: ModelConfig, shape, dtype, sharding) -> jax.Array:
    """A parameter laid out as ``sharding``: each distinct block read once, put on the devices that hold it."""
    index_map = sharding.addressable_devices_indices_map(tuple(shape))
    by_block: dict[tuple, list] = {}
    for device, index in index_map.items():
        cut = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
        by_block.setdefault(tuple((s.start, s.stop) for s in cut), []).append(device)
    on_device = {}
    for key, devices in by_block.items():
        block = _read_block(folder, entry, cfg, tuple(slice(a, b) for a, b in key), dtype)
        on_device.update((d, jax.device_put(block, d)) for d in devices)
        del block
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, [on_device[d] for d in index_map])


def from_hf(path, *, mesh: Mesh, param_dtype: str | None = None, **overrides):
    """A ``Transformer`` with the weights of a Hugging Face folder, every parameter born in its at-rest sharding.

    ``param_dtype``: the parameters' dtype (default ``ModelConfig``'s, float32; the file's dtype is converted).
    ``overrides``: training fields of ``ModelConfig`` (``compute_dtype``, ``attention_impl``, ``remat``, ...);
    the fields ``config.json`` decides (``HF_CONFIG_FIELDS``) cannot be overridden.
    """
    fixed = sorted(set(overrides) & set(HF_CONFIG_FIELDS))
    if fixed:
        raise ValueError(f"{', '.join(fixed)} come from {path}/config.json and cannot be overridden when importing "
                         f"its weights; drop them")
    if param_dtype is not None:
        overrides["param_dtype"] = param_dtype
    cfg = ModelConfig.from_hf(path, **overrides)
    hint = read_json(pathlib.Path(path).expanduser() / "config.json").get("architectures")  # which family's names
    folder = SafetensorsFolder(path)
    folder.check(cfg, hint)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    shardings = {k: v.get_value() for k, v in nnx.to_flat_state(param_shardings(abstract, mesh))}
    by_param = {e.param: e for e in entries(cfg, hint)}
    try:
        for key, var in nnx.to_flat_state(state):
            spec = var.get_value()
            if isinstance(var, fp8.History):  # delayed float8 scaling's amax history: not in the folder, starts empty
                var.set_value(jax.device_put(np.zeros(spec.shape, spec.dtype), shardings[key]))
                continue
            entry = by_param[".".join(map(str, key))]
            var.set_value(_load_param(folder, entry, cfg, spec.shape, spec.dtype, shardings[key]))
            folder.release()  # unmap what this parameter touched
    finally:
        folder.release()
    return nnx.merge(graphdef, state)


# ----------------------------------------------------------------------------------------------
# safetensors out


@jax.jit
def _layer(x, i):
    return jax.lax.dynamic_index_in_dim(x, i, keepdims=False)


def _fetch(x: jax.Array) -> np.ndarray:
    """The whole value of a global array, on every process (a collective when there are several)."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _passthrough(family, source) -> SafetensorsFolder | None:
    """The source folder's tensors that ``family`` carries through export unchanged (``PASSTHROUGH_PREFIXES``: a
    vision-language folder's vision tower), as a ``SafetensorsFolder`` restricted to them; None if it has none."""
    prefixes = getattr(family, "PASSTHROUGH_PREFIXES", ())
    if not prefixes or source is None:
        return None
    folder = SafetensorsFolder(source)
    folder.tensors = {k: v for k, v in folder.tensors.items() if k.startswith(prefixes)}
    return folder


def to_hf(model, path, *, tokenizer_from=None, dtype: str | None = None, max_shard_bytes: int = MAX_SHARD_BYTES):
    """Write ``model`` as a Hugging Face folder that ``AutoModelForCausalLM.from_pretrained(path)`` loads.

    ``path`` must not exist or be empty. ``tokenizer_from``: the original HF folder: its tokenizer files and
    generation_config.json are copied and its config.json gives the token ids (and tells Mistral from Llama).
    ``dtype``: the tensors' dtype in the files (default: the parameters'). Every process must call this (the
    gathers are collectives); process 0 writes.
    """
    from safetensors.numpy import save_file

    cfg, out = model.config, pathlib.Path(path).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} is not an empty folder; export into a new or empty folder")
    source = None if tokenizer_from is None else pathlib.Path(tokenizer_from).expanduser()
    if source is not None and not source.is_dir():
        raise ValueError(f"tokenizer_from {source} is not a folder; pass the Hugging Face folder the model came from")
    src_cfg = read_json(source / "config.json") if source and (source / "config.json").is_file() else {}
    params = {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    dtype = dtype or str(params["embed_VD"].dtype)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"export dtype {dtype!r} must be float32, bfloat16 or float16")
    hint = src_cfg.get("architectures")
    arch, table = export_architecture(cfg, hint), entries(cfg, hint)
    sizes, itemsize = letter_sizes(cfg), jnp.dtype(dtype).itemsize
    rows = [e for e in table if not e.stacked]
    order = [(rows[0], None, None)] + [
        (e, i, j) for i in range(cfg.num_layers) for e in table if e.stacked and i in e.layers(cfg)
        for j in (range(cfg.num_experts) if e.experts else [None])]
    order += [(e, None, None) for e in rows[1:]]
    carried = _passthrough(export_family(cfg, hint), source)
    order += [(None, name, None) for name in sorted(carried.tensors if carried else ())]
    shards: list[list] = [[]]
    used = 0
    for entry, i, j in order:
        n = carried.nbytes(i) if entry is None else math.prod(entry.hf_shape(sizes)) * itemsize
        if shards[-1] and used + n > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((entry, i, j))
        used += n
    writer = jax.process_index() == 0
    if jax.process_count() > 1:  # every process has checked the folder before process 0 writes into it
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("ulysses_jax.to_hf")
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map, total, pieces = {}, 0, {}
    for file, shard in zip(names, shards):
        tensors = {}
        for entry, i, j in shard:
            if entry is None:  # a tensor of the source folder's that export carries unchanged (a vision tower)
                tensors[i] = carried.read(i, (slice(None),))
                weight_map[i] = file
                total += tensors[i].nbytes
                continue
            x = params[entry.param]
            if j is None or j == 0:  # a layer's experts are fetched once, with its first expert
                fetched = _fetch(x if i is None else _layer(x, entry.layers(cfg).index(i)))
            name = tensor_name(entry, i, j)
            one = entry.per_tensor.to_hf(fetched if j is None else fetched[j], sizes)
            if entry.fused is not None:  # written once every piece of the tensor is here
                pieces.setdefault(name, []).append((entry, one))
                if len(pieces[name]) < len(entry.fused.pieces):
                    continue
                one = assemble(pieces.pop(name), sizes)
            tensors[name] = np.ascontiguousarray(one.astype(jnp.dtype(dtype)))
            weight_map[name] = file
            total += tensors[name].nbytes
        if writer:
            save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors
    if carried is not None:
        carried.release()
    if not writer:
        return
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_config(cfg, arch, dtype, src_cfg), indent=2) + "\n")
    if source is not None and (source / "generation_config.json").is_file():
        shutil.copyfile(source / "generation_config.json", out / "generation_config.json")
    else:
        gen = {k: src_cfg[k] for k in ("bos_token_id", "eos_token_id") if src_cfg.get(k) is not None}
        (out / "generation_config.json").write_text(json.dumps({"_from_model_config": True, **gen}, indent=2) + "\n")
    for name in TOKENIZER_FILES if source is not None else ():
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
