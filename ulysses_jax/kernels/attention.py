"""Local (single-device) attention behind one function, ``attention(..., impl=...)``.

Shapes: ``q: [B, S, H, D]``, ``k, v: [B, S, Hkv, D]`` with ``H % Hkv == 0`` (MHA when
``Hkv == H``, GQA when ``1 < Hkv < H``, MQA when ``Hkv == 1``); query head ``h`` reads
KV head ``h // (H // Hkv)``. ``segment_ids: [B, S]`` integers: a token attends only to
tokens of its own document, a run of equal ids (and, when ``causal``, not to later positions); a row that uses one
id for two separate runs is refused (``kernels/segments.py``: one rule for every kernel and the data path). ``window=W``: a causal sliding window,
query ``i`` sees keys ``i - W < j <= i`` (``kernels/window.py``); every implementation takes it. ``sinks: [H]``:
attention sinks (gpt-oss), one logit per query head in each row's softmax denominator (``kernels/sinks.py``); every
implementation but cuDNN takes them.

Implementations (``impl=``):
  * ``"xla"``: the reference below, plain ``jnp``; the softmax is computed in float32
    whatever the input dtype, the output is cast back to the input dtype. It
    materialises the ``[B, H, S, S]`` score matrix, so it is for checking and short
    sequences, not for long contexts.
  * ``"pallas"``: our FlashAttention-2 kernel (``kernels/flash_attention.py``): compiled
    through Triton on GPU, Pallas interpret mode on CPU (exact but slow). Supports
    everything the reference does; memory linear in the sequence length.
  * ``"blockwise"``: exact attention tile by tile in plain ``jnp``/``lax`` loops
    (``kernels/blockwise.py``): online softmax in float32, tiles entirely in the causal future or
    between different documents skipped, a blockwise backward (``custom_vjp``). Supports everything
    the reference does, on any platform; the fast exact path on CPUs (``make train`` in well under
    half the reference's time), memory linear in the sequence length.
  * ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")``, GPU only,
    float16/bfloat16 only, head_dim a multiple of 8 up to 256 on Hopper and later (compute capability 9.0: forward
    and backward, packed rows included, cuDNN's support matrix and jax's own check), up to 128 before. With
    ``segment_ids`` (packed documents), cuDNN's
    packed layout instead (``kernels/cudnn_packed.py``: segment ids turned into per-row document lengths and
    offsets inside the program; Hopper or later; at most ``max_documents`` documents a row).
  * ``"auto"``: resolved per call by ``resolve_impl`` (rule in its docstring).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ulysses_jax.kernels.segments import check_segment_ids, padding_apart
from ulysses_jax.kernels.sinks import check_sinks
from ulysses_jax.kernels.window import check_window

IMPLS = ("xla", "blockwise", "pallas", "cudnn", "auto")


def device_platform(devices) -> str:
    """The platform (``"gpu"``, ``"cpu"``, ...) of the devices a program is built for: a ``Mesh``, an array, or a
    sequence of devices. Compile-only devices of a GPU topology (``ulysses_jax.plan.targets``) report ``"gpu"`` on a
    machine without one, so the same code compiles for H100s from a laptop."""
    if isinstance(devices, jax.sharding.Mesh):
        return devices.devices.flat[0].platform
    if isinstance(devices, jax.Array) and not isinstance(devices, jax.core.Tracer):
        return next(iter(devices.devices())).platform
    if isinstance(devices, np.ndarray):  # an array of devices, or host values (NumPy), which go to the default one
        return devices.flat[0].platform if devices.dtype == object else jax.devices()[0].platform
    return next(iter(devices)).platform


def resolve_impl(impl: str, *, dtype, head_dim: int, has_segment_ids: bool, platform: str | None = None,
                 sinks: bool = False) -> str:
    """The concrete implementation for a request; raises ``ValueError`` if ``impl`` cannot serve it.

    ``platform`` is that of the devices the call runs on (``device_platform(mesh)``); ``None`` means the default
    device's, which is right only for a local call outside any mesh.

    ``"auto"``: on CPU (and any non-GPU platform) ``"blockwise"`` (exact, and faster there than the ``"xla"``
    reference and than Pallas' interpret mode; measured in ``experiments/results/make_train_cpu.md``). On GPU
    ``"cudnn"`` when cuDNN can take the request (packed rows included: float16/bfloat16, head_dim a multiple of 8 and
    at most ``cudnn_max_head_dim()``: 256 on Hopper, 128 before), otherwise ``"pallas"``. Measured on an H100
    (``experiments/results/gpu_h100_20261126``): cuDNN runs
    causal attention at 609 / 527 TFLOP/s forward / backward against our kernel's 398 / 338 (S = 32K, head_dim 128),
    and llama3.2-1b trains 1.76x faster at 32K tokens on cuDNN's packed path than on our kernel. ``sinks``: the call
    has attention sinks, which cuDNN has not: ``"auto"`` picks ``"pallas"`` on GPU, ``"cudnn"`` is refused.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {', '.join(map(repr, IMPLS))}")
    platform = jax.devices()[0].platform if platform is None else platform
    cudnn_problem = _cudnn_problem(dtype=dtype, head_dim=head_dim, has_segment_ids=has_segment_ids, platform=platform,
                                   sinks=sinks)
    if impl == "auto":
        if platform != "gpu":
            return "blockwise"
        return "pallas" if cudnn_problem else "cudnn"
    if impl == "cudnn" and cudnn_problem:
        raise ValueError(f"impl='cudnn' cannot serve this call: {cudnn_problem}; use impl='pallas' or 'auto'")
    return impl


def auto_reason(*, dtype, head_dim: int, platform: str, ring: int = 1, sinks: bool = False) -> str | None:
    """Why ``auto`` does not run cuDNN for such calls on ``platform``'s devices, in a phrase (None: it does, or the
    platform is no GPU, where ``auto`` means ``blockwise``). ``sinks``: the model has attention sinks."""
    if platform != "gpu":
        return None
    if ring > 1:
        return "cuDNN has no ring kernel: a ring step's partial tile runs our kernel"
    problem = _cudnn_problem(dtype=dtype, head_dim=head_dim, has_segment_ids=True, platform=platform, sinks=sinks)
    return None if problem is None else problem.replace("cuDNN attention needs", "cuDNN needs")


def gpu_capability() -> tuple[int, int]:
    """The compute capability of the GPUs programs are built for: the local GPU's on a machine with one; on a machine
    without one, the compile-only targets' (``ulysses_jax.plan.targets``: H100 and H200, 9.0)."""
    if jax.default_backend() != "gpu":
        return (9, 0)
    major, minor = str(getattr(jax.devices()[0], "compute_capability", "9.0")).split(".")[:2]
    return int(major), int(minor)


def cudnn_max_head_dim(capability: tuple[int, int] | None = None) -> int:
    """cuDNN's largest head_dim for training (forward and backward, packed rows included): 256 on Hopper and later,
    128 on Ampere / Ada (cuDNN's support matrix; jax's ``check_is_flash_attention`` draws the same line)."""
    return 256 if (capability or gpu_capability()) >= (9, 0) else 128


def _cudnn_problem(*, dtype, head_dim: int, has_segment_ids: bool, platform: str, sinks: bool = False) -> str | None:
    if platform != "gpu":
        return f"cuDNN needs a GPU but the devices' platform is {platform!r}"
    if sinks:
        return "cuDNN attention has no attention sinks"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN attention needs float16 or bfloat16 inputs, got {jnp.dtype(dtype)}"
    most = cudnn_max_head_dim()
    if head_dim % 8 or head_dim > most:
        return (f"cuDNN attention needs head_dim a multiple of 8 and at most {most} (compute capability "
                f"{'.'.join(map(str, gpu_capability()))}), got {head_dim}")
    return None


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None) -> None:
    """Raise ``ValueError`` naming the values when shapes do not fit ``[B, S, H, D]`` / ``[B, S, Hkv, D]``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape {tuple(x.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    (b, s, h, d), (bk, sk, hkv, dk) = q.shape, k.shape
    if (bk, sk, dk) != (b, s, d):
        raise ValueError(
            f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}: batch, seq and head_dim "
            f"must agree (self-attention), only the head count may differ"
        )
    if hkv == 0 or h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv}) for MHA/GQA/MQA")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if segment_ids is not None:
        if tuple(segment_ids.shape) != (b, s):
            raise ValueError(f"segment_ids must have shape [batch, seq] = {(b, s)}, got {tuple(segment_ids.shape)}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must be integers, got dtype {segment_ids.dtype}")


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    scale: float | None = None,
    impl: str = "xla",
    platform: str | None = None,
    window: int | None = None,
    max_documents: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Local attention ``[B, S, H, D] x [B, S, Hkv, D] -> [B, S, H, D]`` (see module docstring).

    ``max_documents``: with ``impl="cudnn"`` and ``segment_ids``, the static bound M on documents per row of cuDNN's
    packed layout (``kernels/cudnn_packed.py``; None or 0: by the sequence length, ``default_max_documents``); other
    implementations ignore it.
    ``platform``: where the call runs (``"gpu"``, ``"cpu"``); ``None``: the platform of ``q``'s devices, or of the
    default device when ``q`` is traced. Inside ``shard_map`` pass it (``ulysses_attention`` passes its mesh's).
    ``sinks``: ``[H]`` attention-sink logits, in the units of the scaled scores ``q . k * scale``; ``None``: none.
    """
    check_qkv(q, k, v, segment_ids)
    check_segment_ids(segment_ids)
    window = check_window(window, causal=causal)
    sinks = check_sinks(sinks, q.shape[2])
    if platform is None:
        platform = device_platform(q) if not isinstance(q, jax.core.Tracer) else jax.devices()[0].platform
    impl = resolve_impl(impl, dtype=q.dtype, head_dim=q.shape[-1], has_segment_ids=segment_ids is not None,
                        platform=platform, sinks=sinks is not None)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not causal and segment_ids is not None and impl != "cudnn":  # (cuDNN's packed layout leaves padding out)
        segment_ids = padding_apart(segment_ids)
    if impl == "pallas":
        from ulysses_jax.kernels.flash_attention import flash_attention

        # compiled through Triton on GPUs, Pallas interpret mode elsewhere (exact, slow)
        return flash_attention(q, k, v, causal=causal, segment_ids=segment_ids, scale=scale,
                               interpret=platform != "gpu", window=window, sinks=sinks)
    if impl == "blockwise":
        from ulysses_jax.kernels.blockwise import blockwise_attention

        return blockwise_attention(q, k, v, causal=causal, segment_ids=segment_ids, scale=scale, window=window,
                                   sinks=sinks)
    if impl == "cudnn" and segment_ids is not None:  # packed rows: cuDNN's ragged layout (Hopper and later)
        from ulysses_jax.kernels.cudnn_packed import cudnn_packed_attention

        return cudnn_packed_attention(q, k, v, segment_ids, causal=causal, scale=scale, window=window,
                                      max_segments=max_documents, platform=platform)
    if impl == "cudnn":  # (left, right) tokens: i - left <= j <= i + right
        local = None if window is None else (window - 1, 0)
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="cudnn",
                                            local_window_size=local)
    return xla_attention(q, k, v, causal=causal, segment_ids=segment_ids, scale=scale, window=window, sinks=sinks)


def attention_mask(seq_len: int, *, causal: bool, segment_ids: jax.Array | None,
                   window: int | None = None) -> jax.Array:
    """Boolean ``[B or 1, 1, 1, S, S]`` mask (query, key) for the reference."""
    mask = jnp.ones((1, 1, 1, seq_len, seq_len), dtype=bool)
    pos = jnp.arange(seq_len)
    if causal:
        mask = mask & (pos[:, None] >= pos[None, :])
    if window is not None:
        mask = mask & (pos[:, None] - pos[None, :] < window)
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, Sq, Sk]
        mask = mask & same[:, None, None]
    return mask


def xla_attention(q, k, v, *, causal: bool, segment_ids, scale: float, window: int | None = None,
                  sinks: jax.Array | None = None) -> jax.Array:
    """Reference attention in plain jnp; softmax in float32; GQA by grouping query heads; ``sinks [H]`` join each
    row's denominator (plain autodiff differentiates them)."""
    b, s, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    q_bskgd = q.reshape(b, s, hkv, g, d).astype(jnp.float32)
    k_bskd = k.astype(jnp.float32)
    v_bskd = v.astype(jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    logits_bkgqs = jnp.einsum("bqkgd,bskd->bkgqs", q_bskgd, k_bskd, precision=hp) * scale
    mask = attention_mask(s, causal=causal, segment_ids=segment_ids, window=window)
    logits_bkgqs = jnp.where(mask, logits_bkgqs, -jnp.inf)
    # Every row keeps at least its diagonal, so no row is fully masked; guard anyway.
    row_max = jnp.max(logits_bkgqs, axis=-1, keepdims=True)
    if sinks is not None:  # [H] -> [1, Hkv, G, 1, 1], one more logit in each row of its head
        sink = sinks.astype(jnp.float32).reshape(1, hkv, g, 1, 1)
        row_max = jnp.maximum(row_max, sink)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(logits_bkgqs - jax.lax.stop_gradient(row_max))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - jax.lax.stop_gradient(row_max))
    p = p / jnp.where(denom == 0, 1.0, denom)
    out_bqkgd = jnp.einsum("bkgqs,bskd->bqkgd", p, v_bskd, precision=hp)
    return out_bqkgd.reshape(b, s, h, d).astype(q.dtype)
