"""Packed rows (documents marked by segment ids) on cuDNN's fused attention.

cuDNN's flash attention takes packed documents as ragged offsets, not as segment ids: per row, the length of each
document (``seqlen: [B, M]``) and where it starts (``offsets: [B, M + 1]``), ``M`` a static bound on documents per
row, unused entries ``-1`` (jax's ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``; the packed
layout needs a Hopper GPU or later). ``segments_to_ragged`` turns the segment ids the packer writes into those,
inside the program.

The segment-id convention is ``kernels/segments.py``'s, the data path's too: a document is a run of equal ids, the
zeros after a row's last nonzero id are padding, and a row that uses one id for two separate runs is refused (here:
its output is NaN, as cuDNN cannot express one document with a gap). Padding tokens belong to no document: cuDNN
writes nothing meaningful there, so the output is zeroed at padding (their cotangent is zero under a loss that
ignores them, so their gradients are zero too); the other kernels let padding attend to padding, so outputs at
padding differ between kernels and mean nothing.

The bound ``M`` is static: ``resolve_max_documents`` (0: by the row's length), ``M = 1`` takes cuDNN's causal mask
alone (one document from the row's start: ``_ragged``; the padding mask when not causal) and no packed workspace,
whose size ``packed_workspace_bytes`` gives for the planner. A row the bound cannot describe makes the output NaN in
the program; the data path refuses such a batch first (``data.pipeline.check_documents_per_row``), so a wrong mask is
never silent. ``cudnn_forward`` /
``cudnn_backward`` run cuDNN's two primitives apart, for ``parallel/kept.py``. Measured on an H100 (2026-11-26):
``experiments/results/gpu_h100_20261126``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ulysses_jax.kernels.segments import document_starts, padding


def segments_to_ragged(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(seqlen [B, M] int32, offsets [B, M + 1] int32, count [B] int32)`` for segment ids ``[B, S]``.

    ``seqlen[b, j]`` / ``offsets[b, j]``: the length and first position of row ``b``'s ``j``-th document,
    ``-1`` past the row's ``count[b]`` documents (and always in ``offsets``' last entry while ``count < M + 1``).
    Documents past ``M`` are dropped here; ``count > M`` says so (``rows_not_described``).
    """
    b, s = segment_ids.shape
    m = int(max_segments)
    starts = document_starts(segment_ids)
    index = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # document of each token; -1 before the first
    count = index[:, -1] + 1
    rows = jnp.arange(b)[:, None]
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    # scatter each start's position into its document's slot; non-starts go to slot m + 1 (dropped)
    slot = jnp.where(starts, index, m + 1)
    offsets = jnp.full((b, m + 1), -1, jnp.int32).at[rows, slot].set(pos, mode="drop")
    offsets = jnp.where(jnp.arange(m + 1) < m, offsets, -1)  # the (M+1)-th entry stays -1
    real = ~padding(segment_ids) & (index >= 0)
    lengths = jnp.zeros((b, m), jnp.int32).at[rows, jnp.where(real, index, m)].add(1, mode="drop")
    seqlen = jnp.where(jnp.arange(m) < count[:, None], lengths, -1)
    return seqlen, offsets, count


def ragged_mask(seqlen: jax.Array, offsets: jax.Array, seq_len: int, *, causal: bool,
                window: int | None = None) -> jax.Array:
    """The ``[B, 1, 1, S, S]`` boolean mask the ragged description stands for (the reference's layout): query ``i``
    and key ``j`` see each other when both lie in the same listed document (and ``j <= i`` when causal, ``i - j <
    window`` with a window). Used to test ``segments_to_ragged`` against the segment-id mask."""
    pos = jnp.arange(seq_len)
    start = offsets[:, :-1, None]  # [B, M, 1]
    inside = (seqlen[:, :, None] > 0) & (pos >= start) & (pos < start + seqlen[:, :, None])  # [B, M, S]
    same = jnp.einsum("bmq,bmk->bqk", inside.astype(jnp.int32), inside.astype(jnp.int32)) > 0
    if causal:
        same = same & (pos[:, None] >= pos[None, :])
    if window is not None:
        same = same & (pos[:, None] - pos[None, :] < window)
    return same[:, None, None]


MAX_DOCUMENTS = 16  # the most documents per row the default bound allows (short rows)
DOCUMENT_TOKENS = 16 * 32768  # the default bound keeps M x S at most this: 16 at 32K, 4 at 128K, 1 from 512K


def default_max_documents(seq_len: int) -> int:
    """The bound M on documents per row when none is given (``attn_max_documents = 0``): 16 for rows up to 32K
    tokens, then fewer as rows grow (the workspace grows with M x S; long rows hold long documents), 1 from 512K."""
    return max(1, min(MAX_DOCUMENTS, DOCUMENT_TOKENS // max(int(seq_len), 1)))


def resolve_max_documents(max_documents: int | None, seq_len: int) -> int:
    """``max_documents`` itself, or the default for ``seq_len`` when it is None or 0."""
    return default_max_documents(seq_len) if not max_documents else int(max_documents)


def packed_workspace_bytes(batch: int, seq_len: int, heads: int, head_dim: int, max_documents: int) -> int:
    """The temporary memory cuDNN's packed forward+backward takes beyond XLA's buffers, which a compile for a
    compile-only GPU does not show (its workspace reads 0 bytes there): two float32 ``[B * M, S, H, D]`` buffers,
    fitted to an H100 (cuDNN 9.19, S = 32768, H = 32, D = 128: 8.31 GiB at M = 8, 32.50 GiB at M = 32, 1.01 GiB
    unpacked; experiments/results/gpu_h100_20261126). ``M = 1`` takes no packed layout: no more than an unpacked call,
    counted as 0 here."""
    if max_documents <= 1:
        return 0
    return 2 * 4 * batch * max_documents * seq_len * heads * head_dim


def _answer_for_compile_only_targets(platform: str) -> None:
    """jax's Python-side checks ask the local backend for the compute capability, so on a machine without a GPU they
    refuse the packed layout even when compiling for a compile-only H100 (and they run again wherever a transform
    re-traces the forward rule, e.g. under remat). On such a machine the only GPU programs built are for the
    compile-only targets (``ulysses_jax.plan.targets``: H100, H200, compute capability 9.0), so the check is made to
    answer for them, process-wide. A machine with a GPU keeps jax's own check."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

    if platform != "gpu" or jax.default_backend() == "gpu" or getattr(cudnn_fa, "_ulysses_target", False):
        return
    cudnn_fa.check_compute_capability = lambda c: tuple(int(x) for x in c.split(".")) <= (9, 0)
    cudnn_fa._ulysses_target = True


def _ragged(segment_ids, max_segments: int | None, causal: bool = False) -> tuple[dict, jax.Array]:
    """cuDNN's keyword arguments for the rows of ``segment_ids`` (None, or none needed: no mask beyond causal), and
    whether some row cannot be described: more documents than the bound (``M = 1``: more than one; zeros before a
    document are a document of their own, ``kernels/segments.py``), or one id for two separate runs, found among the
    runs listed.

    ``M = 1`` and ``causal``: no arguments, cuDNN's causal mask alone. The row is one document from its start, then
    padding, and under causality no token of the document reads a later token, so the document's outputs and
    gradients are those of the padding mask exactly; the padding's own rows (they read the document) are zeroed by
    ``around_packed``, output and gradients. Without causality the padding mask stays."""
    if segment_ids is None:
        return {}, jnp.zeros((), bool)
    m = resolve_max_documents(max_segments, segment_ids.shape[1])
    if m <= 1:
        bad = jnp.any(jnp.sum(document_starts(segment_ids), axis=1) > 1)
        if causal:
            return {}, bad
        seqlen = jnp.sum(~padding(segment_ids), axis=1, dtype=jnp.int32)
        return dict(q_seqlen=seqlen, kv_seqlen=seqlen), bad
    seqlen, offsets, count = segments_to_ragged(segment_ids, m)
    listed = offsets[:, :m] >= 0
    ids = jnp.take_along_axis(segment_ids, jnp.maximum(offsets[:, :m], 0), axis=1)  # [B, M]: each run's id
    later = jnp.arange(m)[:, None] < jnp.arange(m)[None, :]
    split = jnp.any(listed[:, :, None] & listed[:, None, :] & later & (ids[:, :, None] == ids[:, None, :]))
    return (dict(q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets, kv_offsets=offsets),
            jnp.any(count > m) | split)


def rows_not_described(segment_ids, max_segments: int | None) -> jax.Array:
    """Scalar bool: a row cuDNN's packed layout cannot describe with the bound (``_ragged``)."""
    return _ragged(segment_ids, max_segments)[1]


def _mask_type(cudnn_fa, causal: bool, packed: bool):
    if packed:
        return cudnn_fa.MaskType.PADDING_CAUSAL if causal else cudnn_fa.MaskType.PADDING
    return cudnn_fa.MaskType.CAUSAL if causal else cudnn_fa.MaskType.NO_MASK


def cudnn_packed_attention(q, k, v, segment_ids, *, causal: bool, scale: float, max_segments: int | None = None,
                           window: int | None = None, platform: str = "gpu") -> jax.Array:
    """cuDNN flash attention over packed rows, ``[B, S, H, D]`` layout (GQA: fewer K/V heads). GPU (Hopper+) only.

    ``max_segments`` (M) bounds the documents of a row (None or 0: ``default_max_documents(S)``). ``M = 1``: one
    document from the row's start, then padding: cuDNN's causal mask alone when causal (exact: ``_ragged``), else its
    padding mask (no packed workspace either way); ``M > 1``: the packed (ragged) layout, whose workspace grows with M
    (``packed_workspace_bytes``). Q, K and V are zeroed at
    padding before the call, so the gradients there are exactly zero: measured on an H100 (cuDNN 9.19, jax 0.11.2,
    2026-11-26), cuDNN's packed backward left dK / dV at tokens outside every document wrong with GQA (relative
    errors 0.4-0.8 against the reference until masked). A row the bound cannot describe (more than M documents; with
    M = 1, a document not at the row's start) makes the whole output NaN: never a silent wrong mask. The training
    loop refuses such a batch before the step (``ulysses_jax.data.pipeline.check_documents_per_row``) and stops on
    a non-finite loss.
    """
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

    ragged, _ = _ragged(segment_ids, max_segments, causal)
    _answer_for_compile_only_targets(platform)
    kind = _mask_type(cudnn_fa, causal, bool(ragged))
    return around_packed(lambda q, k, v: cudnn_fa.dot_product_attention(
        q, k, v, scale=scale, mask_type=kind, qkv_layout="BTNH", sliding_window_length=window, **ragged),
        q, k, v, segment_ids, max_segments)


def around_packed(call, q, k, v, segment_ids, max_segments: int | None) -> jax.Array:
    """``call(q, k, v)`` on packed rows as every cuDNN path needs it: the gradients of Q, K, V exactly zero at
    padding, the output zeroed there, all NaN when a row is beyond the bound (``rows_not_described``).

    Q, K and V reach cuDNN as they are: the ragged offsets describe the documents only, so no token of a document
    reads a padding token, and the output there is zeroed. Only their gradients are masked (``_zero_grad_at``);
    masking the inputs themselves (as this did) made a copy of each whole-sequence Q, K, V beside the original,
    4 GiB apiece at Qwen3.5-9B's 8M tokens under sp = 8."""
    mask = ~padding(segment_ids)[:, :, None, None]
    q, k, v = (_zero_grad_at(x, mask) for x in (q, k, v))
    # the zero read off Q (0 even where Q's first value is not finite): a constant here would be hoisted out of a
    # loop that calls this (the tiled attention sublayer's head groups) and broadcast there to whole-sequence arrays,
    # one of zeros and one of NaN (4 GiB each at Qwen3.5-9B's 8M tokens under sp = 8)
    first = jax.lax.stop_gradient(q.reshape(-1)[0])
    zero = jnp.where(jnp.isfinite(first), first * 0, jnp.zeros((), q.dtype))
    out = jnp.where(mask, call(q, k, v), zero)
    return jnp.where(rows_not_described(segment_ids, max_segments), zero + jnp.nan, out)


@jax.custom_vjp
def _zero_grad_at(x, keep):
    """``x`` itself; its gradient zero where ``keep`` (broadcast to ``x``) is False."""
    return x


def _zero_grad_fwd(x, keep):
    return x, keep


def _zero_grad_bwd(keep, g):
    return jnp.where(keep, g, jnp.zeros((), g.dtype)), None


_zero_grad_at.defvjp(_zero_grad_fwd, _zero_grad_bwd)


# ------------------------------------------------------------------ forward and backward apart (kept attention)
# jax's cuDNN attention is one custom_vjp whose residuals (the output and its softmax statistics) cannot be named for
# a remat policy; ``parallel/kept.py`` runs the two primitives itself, through jax's private module (pinned by the
# compile-only tests and tests/test_gpu.py), with the arguments jax's public wrapper passes them.


def _primitive_args(cudnn_fa, q, k, v, segment_ids, causal: bool, window, max_segments, platform):
    _answer_for_compile_only_targets(platform)
    ragged, _ = _ragged(segment_ids, max_segments, causal)
    empty = jnp.zeros(0, dtype=q.dtype)
    layout = cudnn_fa._normalize_layout("BTNH")
    cudnn_fa.check_layout(q, k, v, None, ragged.get("q_seqlen"), ragged.get("kv_seqlen"), ragged.get("q_offsets"),
                          ragged.get("kv_offsets"), None, None, layout)
    operands = (q, k, v, empty, ragged.get("q_seqlen", empty), ragged.get("kv_seqlen", empty),
                ragged.get("q_offsets", empty), ragged.get("kv_offsets", empty), empty, empty)
    params = dict(seed=42, dropout_rate=0.0, variadic_args=(False, False),
                  mask_type=_mask_type(cudnn_fa, causal, bool(ragged)), layout=layout.value,
                  sliding_window_length=window)
    packed = cudnn_fa.get_max_seg_per_batch(ragged["q_offsets"]) > 1 if "q_offsets" in ragged else False
    return operands, params, layout, packed


def cudnn_forward(q, k, v, segment_ids, *, causal: bool, scale: float, window=None, max_segments=None,
                  platform: str = "gpu"):
    """``(o, softmax statistics)``: cuDNN's training forward alone (the statistics are its log-sum-exp, in the shape
    cuDNN keeps them: ``[B * M, H, S]`` float32 with packed rows)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

    operands, params, layout, packed = _primitive_args(cudnn_fa, q, k, v, segment_ids, causal, window, max_segments,
                                                       platform)
    cudnn_fa.check_is_flash_attention(q, k, v, layout.value, cudnn_fa.check_cudnn_version(), False, True, packed)
    o, stats = cudnn_fa._dot_product_attention_fwd_p_wrapper.bind(*operands, scale=scale, is_training=True, **params)
    return o, stats


def cudnn_backward(q, k, v, segment_ids, o, stats, do, *, causal: bool, scale: float, window=None, max_segments=None,
                   platform: str = "gpu"):
    """``(dq, dk, dv)``: cuDNN's backward alone, from the forward's output and statistics (``cudnn_forward``)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

    operands, params, _, _ = _primitive_args(cudnn_fa, q, k, v, segment_ids, causal, window, max_segments, platform)
    grads = cudnn_fa._dot_product_attention_bwd_p_wrapper.bind(*operands, stats, o, do.astype(o.dtype), scale=scale,
                                                               **params)
    return tuple(grads[:3])
