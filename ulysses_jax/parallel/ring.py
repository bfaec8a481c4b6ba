"""Ring attention over one mesh axis: exact, causal load balanced (zigzag), with a ring backward.

Called inside ``shard_map`` on local blocks. The sequence is split over the ``ring`` axis: device ``r`` of
``R`` holds ``s = S / R`` tokens of Q, K and V (after the Ulysses all-to-all, when combined with ``sp``:
:func:`ulysses_ring_local`). Each device keeps its queries; the KV block travels: ``R`` steps, and between
steps one ``ppermute`` passes ``[K; V]`` (stacked: **one** collective-permute per step, only the KV heads
the device holds, so GQA makes it cheap) and the segment ids (a second, small int32 permute) to the next
rank. At step ``t`` device ``r`` holds the KV block of rank ``(r - t) mod R``. Partial outputs merge by
log-sum-exp in float32. Per device, forward: ``R - 1`` permutes of ``2·b·s·Hkv·D·itemsize`` bytes (plus
``R - 1`` of ``4·b·s`` with segment ids). The block for step ``t + 1`` is sent while step ``t`` computes,
and an optimisation barrier makes that send wait for step ``t - 1``: one block in flight at a time,
hidden behind a step (without it XLA:GPU issues every permute at once, holding all ``R`` blocks, with
only the last one overlapped; ``tests/test_ring.py`` reads the overlap from the compiled H100 program).

Token order (the caller's job, once, at the input). The local blocks are cut from the global sequence
after a permutation ``order`` of its tokens: ``"contiguous"`` (identity; the last rank does ``R`` times the
causal work of the first) or ``"zigzag"`` (:func:`zigzag_order`: ``2R`` chunks, rank ``r`` holds chunks
``r`` and ``2R-1-r``, so every rank does the same work, :func:`ring_work`). Permute tokens, positions (RoPE),
segment ids and labels (shift them *before* permuting) with the same ``zigzag_order(S, R)`` and split the
permuted sequence contiguously over the ring (ring-major over ``("ring", "sp")`` when combined); apply
:func:`zigzag_inverse` to outputs if they leave the model in sequence order. A token-sum loss is unchanged.
The masks use each token's global position (its index in the *unpermuted* sequence), derived from
``order`` and the rank, so causality is exact in any order; segment ids are compared as they are.

Per step the KV block is cut into the same ``n`` chunks as the queries (``n = 2`` for causal zigzag, one
per contiguous run, else 1) and each (query chunk, KV chunk) pair is classified from position ranges
(:func:`block_kind`): ``SKIP`` (entirely in the causal future: no compute), ``FULL`` (entirely in the
past: no causal mask) or ``DIAG`` (the causal mask by positions). Positions depend only on the order and
the rank, so the whole schedule is a static table (:func:`ring_schedule`); per pair the program holds
only the kinds that occur on some rank and a ``lax.switch`` on the rank picks one (none when all ranks
agree). Equal-size aligned chunks make every ``DIAG`` pair one whose query and key positions coincide.
Under zigzag a rank computes ``2R + 1`` chunk pairs of ``(S/2R)^2`` whatever its rank: 3 on its own
block (two ``DIAG``, one ``FULL``), 2 ``FULL`` on every other.

Backward (``custom_vjp``): residuals are the local q, k, v, segment ids, output and lse, nothing per
step. It runs the ring again, the other way round (blocks go to ``r - 1``: its rotations differ from the
forward's, so XLA cannot merge the two and keep all ``R`` KV blocks alive between the passes, which it
does on CPU even through an optimisation barrier), recomputing each pair's probabilities from the saved
global lse. dQ accumulates locally; dK/dV (float32) travel with their KV block and after ``R`` hops
arrive home: ``R - 1`` permutes of ``[K; V]``, ``R`` of ``[dK; dV]`` (``2·b·s·Hkv·D·4`` bytes each),
``R - 1`` of segment ids. Each step's contribution goes into a fresh buffer added to the arriving one, so
the dK/dV transfer can overlap the step too. Byte formulas: :func:`ring_permute_bytes`.

Swapping the local kernel. Everything local is a :class:`LocalKernel`: ``forward(q, k, v, q_pos, k_pos,
q_seg, k_seg, *, causal, scale) -> (o, lse)`` (``o`` float32 ``[b, sq, h, d]`` normalised, ``lse`` float32
``[b, h, sq]`` natural log, ``-inf`` for a row that sees no key) and ``backward(..., do, lse, delta, *,
causal, scale) -> (dq, dk, dv)`` in float32 given the *global* lse and ``delta = rowsum(dO * O)``.
``causal=True`` is only asked for ``DIAG`` pairs, whose query and key positions coincide, so a kernel
with the usual aligned causal flag serves. Three kernels (:func:`ring_kernel` picks by ``impl`` and platform):
``XLA_KERNEL``, the plain ``jnp`` one below; ``BLOCKWISE_KERNEL`` (``kernels/blockwise.py``, tiles in lax loops);
``PALLAS_KERNEL``, our FlashAttention kernels (``kernels/flash_attention.py``: ``pair_forward`` /
``pair_backward``, the same Triton kernels with float32 outputs, separate query and key segment ids and the
log-sum-exp converted from base 2), in Pallas interpret mode off GPUs (``PALLAS_INTERPRET_KERNEL``).

Attention sinks (``kernels/sinks.py``): the sink enters once, as the accumulator's starting point (output 0, lse the
sink: a key of value zero), never through a step's kernel; the backward hands every pair the global lse and delta,
which include it, and adds the sinks' own gradient once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ulysses_jax.kernels import blockwise, flash_pair
from ulysses_jax.kernels.xla_pair import xla_backward, xla_forward
from ulysses_jax.kernels.attention import check_qkv
from ulysses_jax.kernels.sinks import check_sinks, sink_grad, vary_like
from ulysses_jax.kernels.window import FULL, MASKED, SKIP, block_kind, check_window
from ulysses_jax.parallel.exchange import heads_to_seq, local_sinks, seq_to_heads
from ulysses_jax.parallel.head_layout import HeadLayout

ORDERS = ("zigzag", "contiguous")
DIAG = MASKED  # a pair that needs the mask by positions (causal, and the window when there is one)
_HIGHEST = lax.Precision.HIGHEST
_F32 = jnp.float32

# ---------------------------------------------------------------------------------------------------
# Token order and the per-step schedule
# ---------------------------------------------------------------------------------------------------


def zigzag_order(seq_len: int, ring: int) -> np.ndarray:
    """The permutation ``perm`` (``x_permuted = x[:, perm]``) after which rank ``r`` of a contiguous split
    holds chunks ``r`` and ``2R - 1 - r`` of ``2R`` equal chunks: equal causal work on every rank."""
    if seq_len % (2 * ring):
        raise ValueError(f"sequence length ({seq_len}) must be divisible by 2 * ring ({2 * ring}) for the zigzag order")
    chunks = np.arange(seq_len).reshape(2 * ring, seq_len // (2 * ring))
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * ring - 1 - r]]) for r in range(ring)])


def zigzag_inverse(seq_len: int, ring: int) -> np.ndarray:
    """The inverse permutation: ``x = x_permuted[:, zigzag_inverse(S, R)]``."""
    return np.argsort(zigzag_order(seq_len, ring))


def sequence_order(order: str, seq_len: int, ring: int) -> np.ndarray:
    """Global position of each token of the permuted sequence: ``arange`` or :func:`zigzag_order`."""
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; choose one of {', '.join(map(repr, ORDERS))}")
    if seq_len % ring:
        raise ValueError(f"sequence length ({seq_len}) must be divisible by ring ({ring})")
    return zigzag_order(seq_len, ring) if order == "zigzag" else np.arange(seq_len)


@functools.lru_cache(maxsize=64)
def ring_schedule(order: str, seq_len: int, ring: int, causal: bool, window: int | None = None) -> np.ndarray:
    """``kinds[r, src, i, j]``: what query chunk ``i`` of rank ``r`` x KV chunk ``j`` of rank ``src`` needs
    (``window.block_kind``: with a window, pairs entirely behind it are ``SKIP`` too).

    Static (positions depend only on the order and the rank), so :func:`ring_attention` compiles per pair
    only the kinds that occur on some rank and picks among them by rank at run time.
    """
    n = 2 if order == "zigzag" and causal else 1  # without a causal mask the order does not matter
    pos = sequence_order(order, seq_len, ring).reshape(ring, n, -1)
    kinds = np.array([[[[block_kind(pos[r, i], pos[src, j], causal, window) for j in range(n)] for i in range(n)]
                       for src in range(ring)] for r in range(ring)], dtype=np.int32)
    kinds.setflags(write=False)  # cached: shared by every caller
    return kinds


@functools.lru_cache(maxsize=64)
def ring_offsets(order: str, seq_len: int, ring: int, causal: bool) -> np.ndarray:
    """``offsets[r, src, i, j]``: first query position minus first key position of each pair (chunks are runs of
    consecutive positions, so query row ``i`` sits at key position ``i + offset``); static like the kinds."""
    n = 2 if order == "zigzag" and causal else 1
    first = sequence_order(order, seq_len, ring).reshape(ring, n, -1)[:, :, 0]
    offsets = first[:, None, :, None] - first[None, :, None, :]
    offsets.setflags(write=False)
    return offsets


def active_steps(kinds: np.ndarray, direction: int) -> list[int]:
    """The ring steps at which some rank has a pair to compute (blocks travelling ``direction``); the others are
    skipped whole: no compute, and the KV block jumps over them in one permute."""
    ring = kinds.shape[0]
    ranks = np.arange(ring)
    return [t for t in range(ring) if (kinds[ranks, (ranks - t * direction) % ring] != SKIP).any()]


def ring_work(seq_len: int, ring: int, *, order: str, causal: bool = True, window: int | None = None) -> np.ndarray:
    """Per rank, the (query, key) token pairs the kernel computes over all steps (masked entries of ``DIAG``
    pairs included), from the schedule :func:`ring_attention` runs."""
    kinds = ring_schedule(order, seq_len, ring, causal, window)
    chunk = seq_len // ring // kinds.shape[-1]
    return (kinds != SKIP).sum(axis=(1, 2, 3)) * chunk * chunk


def ring_permute_bytes(*, batch: int, tokens: int, kv_heads: int, head_dim: int, itemsize: int, ring: int,
                       segment_ids: bool, steps: tuple[int, int] | None = None) -> dict[str, tuple[int, int]]:
    """Per device ``{what: (count, bytes of each collective-permute)}`` of one forward and one backward
    (``batch``, ``tokens`` and ``kv_heads`` local: ``tokens = S / R``). ``steps``: ``(active forward steps, whether
    the backward's last active step is not its first)`` with a window (:func:`active_steps`); default all ``R``."""
    active, home = steps or (ring, ring > 1)
    kv = 2 * batch * tokens * kv_heads * head_dim
    out = {"forward_kv": (active - 1, kv * itemsize), "backward_kv": (active - 1, kv * itemsize),
           "backward_dkv": (active - 1 + int(home), kv * 4)}
    if segment_ids:
        ids = (active - 1, 4 * batch * tokens)
        out |= {"forward_segment_ids": ids, "backward_segment_ids": ids}
    return out


# ---------------------------------------------------------------------------------------------------
# The local kernel: one (query block, KV block) pair, with the log-sum-exp
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LocalKernel:
    """Attention on one (query block, KV block) pair; the contract is in the module doc."""

    forward: Callable
    backward: Callable


XLA_KERNEL = LocalKernel(xla_forward, xla_backward)
# tile by tile in lax loops: memory linear in the block length (kernels/blockwise.py)
BLOCKWISE_KERNEL = LocalKernel(blockwise.pair_forward, blockwise.pair_backward)
# our FlashAttention kernels (kernels/flash_attention.py): Triton on GPUs, Pallas interpret mode elsewhere
PALLAS_KERNEL = LocalKernel(functools.partial(flash_pair.pair_forward, interpret=False),
                            functools.partial(flash_pair.pair_backward, interpret=False))
PALLAS_INTERPRET_KERNEL = LocalKernel(functools.partial(flash_pair.pair_forward, interpret=True),
                                      functools.partial(flash_pair.pair_backward, interpret=True))
RING_IMPLS = ("xla", "blockwise", "pallas", "auto")


def ring_kernel(impl: str, platform: str = "gpu", *, float32: bool = True) -> LocalKernel:
    """The local kernel of each ring step for an attention ``impl`` on ``platform`` (the mesh's devices').

    ``"auto"``: ``"pallas"`` on GPUs, as without a ring; ``"blockwise"`` elsewhere (faster than interpret mode).
    ``float32=False``: the Pallas kernels write ``o``, ``dq``, ``dk``, ``dv`` in the inputs' dtype instead (for a
    caller that keeps them whole, ``model/tiled_attention.py``); the others compute and return float32 either way."""
    if impl not in RING_IMPLS:
        raise ValueError(f"attention impl={impl!r} has no ring kernel; with a ring use one of "
                         f"{', '.join(map(repr, RING_IMPLS))}")
    if impl == "auto":
        impl = "pallas" if platform == "gpu" else "blockwise"
    if impl == "pallas":
        if not float32:
            interpret = platform != "gpu"
            return LocalKernel(functools.partial(flash_pair.pair_forward, interpret=interpret, float32=False),
                               functools.partial(flash_pair.pair_backward, interpret=interpret, float32=False))
        return PALLAS_KERNEL if platform == "gpu" else PALLAS_INTERPRET_KERNEL
    return XLA_KERNEL if impl == "xla" else BLOCKWISE_KERNEL

# ---------------------------------------------------------------------------------------------------
# The ring: forward steps, custom_vjp, backward steps
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything static about one call (hashable: the custom_vjp's nondiff argument)."""

    axis_name: str
    ring: int
    order: str
    causal: bool
    scale: float
    kernel: LocalKernel
    window: int | None = None

    def schedule(self, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """The static pair kinds and offsets (:func:`ring_schedule`, :func:`ring_offsets`) of this call."""
        seq = tokens * self.ring
        return (ring_schedule(self.order, seq, self.ring, self.causal, self.window),
                ring_offsets(self.order, seq, self.ring, self.causal))

    def positions(self, tokens: int, rank) -> jax.Array:
        """Global positions ``[tokens]`` of the local tokens of ``rank`` (traced): runs of consecutive positions
        from a small ``[R, runs]`` table of starts, never an ``[S]`` constant in the program."""
        runs = 2 if self.order == "zigzag" else 1
        starts = sequence_order(self.order, tokens * self.ring, self.ring).reshape(self.ring, runs, -1)[:, :, 0]
        offsets = jnp.arange(tokens // runs, dtype=jnp.int32)
        return (jnp.asarray(starts, jnp.int32)[rank][:, None] + offsets).reshape(tokens)

    def rotate(self, x, direction: int):
        """Send to rank ``r + direction`` on the ring, receive from ``r - direction``."""
        return lax.ppermute(x, self.axis_name, [(i, (i + direction) % self.ring) for i in range(self.ring)])

    def step_kinds(self, kinds: np.ndarray, t: int, direction: int) -> np.ndarray:
        """``[R, n, n]``: each rank's pair kinds (or offsets) at step ``t``, when blocks travel ``direction``: it
        holds the block of rank ``r - t * direction``."""
        ranks = np.arange(self.ring)
        return kinds[ranks, (ranks - t * direction) % self.ring]

    def step_pairs(self, kinds, offsets, t: int, direction: int) -> np.ndarray:
        """``[R, n, n]`` per rank and pair: ``-1`` to skip, ``0`` unmasked, ``1 + offset`` masked by positions."""
        k, o = self.step_kinds(kinds, t, direction), self.step_kinds(offsets, t, direction)
        return np.where(k == SKIP, -1, np.where(k == FULL, 0, 1 + o))


def _split(x, n: int, axis: int):
    return [None] * n if x is None else jnp.split(x, n, axis=axis)


def _merge(o, lse, o_b, lse_b):
    """Combine two normalised partial outputs by their log-sum-exps (float32; -inf for nothing seen)."""
    new = jnp.logaddexp(lse, lse_b)
    ref = jnp.where(jnp.isfinite(new), new, 0.0)
    w, w_b = (jnp.swapaxes(jnp.exp(x - ref), 1, 2)[..., None] for x in (lse, lse_b))  # [b, sq, H, 1]
    return o * w + o_b * w_b, new


def _dispatch(pairs: np.ndarray, rank, run: Callable, carry):
    """``run(causal, offset, carry) -> carry`` for this rank's pair (``pairs``: per rank, ``Config.step_pairs``'s
    code); a skipped pair returns ``carry``. A code shared by every rank is called directly; otherwise one
    ``lax.switch`` on the rank over the codes that occur."""
    def branch(code):
        return (lambda c: c) if code < 0 else functools.partial(run, code > 0, max(code - 1, 0))

    present = sorted(set(pairs.tolist()))
    if len(present) == 1:
        return branch(present[0])(carry)
    index = jnp.asarray([present.index(k) for k in pairs.tolist()], jnp.int32)[rank]
    return lax.switch(index, [branch(k) for k in present], carry)


def _window_kw(cfg: _Config, causal: bool, offset: int) -> dict:
    """The local kernel's window arguments for a pair: none for an unmasked one (or without a window)."""
    return dict(window=cfg.window, offset=offset) if causal and cfg.window is not None else {}


def _ring_forward(q, k, v, seg, cfg: _Config, sinks=None):
    tokens, rank = q.shape[1], lax.axis_index(cfg.axis_name)
    q_pos, (kinds, offsets) = cfg.positions(tokens, rank), cfg.schedule(tokens)
    n = kinds.shape[-1]  # chunks per block
    qs, q_poss, q_segs = _split(q, n, 1), _split(q_pos, n, 0), _split(seg, n, 1)
    acc = [(jnp.zeros_like(c, _F32), jnp.full_like(jnp.swapaxes(c[..., 0], 1, 2), -jnp.inf, _F32)) for c in qs]
    if sinks is not None:  # the sinks start the merge: output 0 with the sink's logit as log-sum-exp
        acc = [(o, jnp.zeros_like(lse) + sinks.astype(_F32)[None, :, None]) for o, lse in acc]
    kv, kv_seg = jnp.stack([k, v]), seg  # [2, b, s, Hkv, D]: K and V cross in one permute
    steps = active_steps(kinds, 1)  # steps no rank needs (outside every window) are skipped whole
    for t, t_next in zip(steps, steps[1:] + [None]):
        if t_next is not None:  # next step's block is in flight while this one is computed
            hop = t_next - t
            kv_next, seg_next = cfg.rotate(kv, hop), None if seg is None else cfg.rotate(kv_seg, hop)
        ks, vs = _split(kv[0], n, 1), _split(kv[1], n, 1)
        k_poss, k_segs = _split(cfg.positions(tokens, (rank - t) % cfg.ring), n, 0), _split(kv_seg, n, 1)
        pairs = cfg.step_pairs(kinds, offsets, t, 1)
        for i in range(n):
            for j in range(n):
                def run(causal, offset, carry, i=i, j=j):
                    o_b, lse_b = cfg.kernel.forward(qs[i], ks[j], vs[j], q_poss[i], k_poss[j], q_segs[i], k_segs[j],
                                                    causal=causal, scale=cfg.scale, **_window_kw(cfg, causal, offset))
                    return _merge(*carry, o_b, lse_b)

                acc[i] = _dispatch(pairs[:, i, j], rank, run, acc[i])
        if t_next is not None:  # the next send waits for this step's compute: one block in flight at a time
            acc, kv, kv_seg = lax.optimization_barrier((acc, kv_next, seg_next))
    out = jnp.concatenate([o for o, _ in acc], axis=1).astype(q.dtype)
    return out, jnp.concatenate([lse for _, lse in acc], axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring(q, k, v, seg, sinks, cfg: _Config):
    return _ring_forward(q, k, v, seg, cfg, sinks)[0]


def _ring_fwd(q, k, v, seg, sinks, cfg: _Config):
    out, lse = _ring_forward(q, k, v, seg, cfg, sinks)
    return out, (q, k, v, seg, sinks, out, lse)


def _ring_bwd(cfg: _Config, res, do):
    q, k, v, seg, sinks, out, lse = res
    tokens, rank = q.shape[1], lax.axis_index(cfg.axis_name)
    q_pos, (kinds, offsets) = cfg.positions(tokens, rank), cfg.schedule(tokens)
    n = kinds.shape[-1]  # chunks per block
    delta = jnp.einsum("bshd,bshd->bhs", do.astype(_F32), out.astype(_F32), precision=_HIGHEST)
    qs, q_poss, q_segs, dos = _split(q, n, 1), _split(q_pos, n, 0), _split(seg, n, 1), _split(do, n, 1)
    lses, deltas = _split(lse, n, 2), _split(delta, n, 2)
    dqs = [jnp.zeros_like(c, _F32) for c in qs]
    kv, kv_seg, dkv, hop = jnp.stack([k, v]), seg, None, 0
    steps = active_steps(kinds, -1)
    for t, t_next in zip(steps, steps[1:] + [None]):
        if t_next is not None:
            kv_next, seg_next = cfg.rotate(kv, t - t_next), None if seg is None else cfg.rotate(kv_seg, t - t_next)
        ks, vs = _split(kv[0], n, 1), _split(kv[1], n, 1)
        k_poss, k_segs = _split(cfg.positions(tokens, (rank + t) % cfg.ring), n, 0), _split(kv_seg, n, 1)
        pairs = cfg.step_pairs(kinds, offsets, t, -1)
        dks, dvs = [jnp.zeros_like(c, _F32) for c in ks], [jnp.zeros_like(c, _F32) for c in vs]
        for i in range(n):
            for j in range(n):
                def run(causal, offset, carry, i=i, j=j):
                    g = cfg.kernel.backward(qs[i], ks[j], vs[j], q_poss[i], k_poss[j], q_segs[i], k_segs[j], dos[i],
                                            lses[i], deltas[i], causal=causal, scale=cfg.scale,
                                            **_window_kw(cfg, causal, offset))
                    return tuple(a + b for a, b in zip(carry, g))

                dqs[i], dks[j], dvs[j] = _dispatch(pairs[:, i, j], rank, run, (dqs[i], dks[j], dvs[j]))
        step = jnp.stack([jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1)])
        # this block's gradient so far arrives from the rank holding it next while this step computed its share
        dkv = step if dkv is None else cfg.rotate(dkv, -hop) + step
        if t_next is not None:
            hop = t_next - t
            dqs, dkv, kv, kv_seg = lax.optimization_barrier((dqs, dkv, kv_next, seg_next))
    if steps[-1] % cfg.ring:
        dkv = cfg.rotate(dkv, steps[-1])  # the last holder is rank owner - t_last: one hop home
    dq = jnp.concatenate(dqs, axis=1).astype(q.dtype)
    dsinks = None if sinks is None else sink_grad(sinks, lse, delta)
    return dq, dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None, dsinks


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q, k, v, *, axis_name: str, causal: bool = True, segment_ids=None, scale: float | None = None,
                   order: str = "zigzag", kernel: LocalKernel = XLA_KERNEL, window: int | None = None,
                   sinks=None) -> jax.Array:
    """Exact attention over the sequence split on ``axis_name``; call inside ``shard_map``.

    Local blocks: ``q [b, s, H, D]``, ``k, v [b, s, Hkv, D]``, ``segment_ids [b, s]`` integers or ``None``,
    where ``s = S / R`` are this rank's tokens of the global sequence permuted by ``sequence_order(order,
    S, R)`` (``zigzag_order`` for ``"zigzag"``) and split contiguously over the axis. Returns the local
    output ``[b, s, H, D]`` in the input dtype, in the same permuted order. Differentiable (ring backward).
    ``window``: a causal sliding window over the global positions; steps outside every rank's window are skipped.
    ``sinks``: ``[H]`` attention-sink logits of the local heads (``kernels/sinks.py``), or None.
    """
    check_qkv(q, k, v, segment_ids)
    ring = lax.axis_size(axis_name)
    s = q.shape[1]
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; choose one of {', '.join(map(repr, ORDERS))}")
    if order == "zigzag" and s % 2:
        raise ValueError(f"local sequence length ({s}) must be even for the zigzag order "
                         f"(the sequence divisible by 2 * {axis_name} = {2 * ring})")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    window = check_window(window, causal=causal)
    sinks = None if check_sinks(sinks, q.shape[2]) is None else vary_like(sinks, q)
    return _ring(q, k, v, segment_ids, sinks, _Config(axis_name, ring, order, causal, scale, kernel, window))


# ---------------------------------------------------------------------------------------------------
# Ulysses x ring (2-D sequence parallelism)
# ---------------------------------------------------------------------------------------------------


def ulysses_ring_local(q, k, v, segment_ids=None, *, sp_axis: str, ring_axis: str, layout: HeadLayout,
                       causal: bool = True, scale: float | None = None, order: str = "zigzag",
                       kernel: LocalKernel = XLA_KERNEL, window: int | None = None, sinks=None) -> jax.Array:
    """Ulysses inside an ``sp`` group, ring attention across ``ring``: the body of a ``shard_map`` over both.

    Local ``q [b, S/(R·P), H, D]``, ``k, v [b, S/(R·P), Hkv, D]``, ``segment_ids [b, S/(R·P)]``: the global
    sequence permuted by ``sequence_order(order, S, R)`` and split over ``(ring_axis, sp_axis)`` jointly,
    ring-major (``P(batch, (ring_axis, sp_axis))``). ``layout = plan_heads(H, Hkv, P)``. The first all-to-all
    gives ``[b, S/R, hq, D]`` queries and ``[b, S/R, k_loc, D]`` KV heads (segment ids all-gathered over
    ``sp``), the ring runs on those, the second all-to-all returns ``[b, S/(R·P), H, D]``. ``sinks``: all ``[H]``
    heads' (replicated); each device takes its query heads'.
    """
    sp, d = layout.sp, q.shape[-1]
    hq, kl = layout.heads_per_device, layout.kv_per_device
    bl, sl = q.shape[:2]
    parts = [layout.gather_q(q).reshape(bl, sl, sp, hq, d), layout.gather_kv(k).reshape(bl, sl, sp, kl, d),
             layout.gather_kv(v).reshape(bl, sl, sp, kl, d)]
    qkv = jnp.concatenate(parts, axis=3).reshape(bl, sl, sp * (hq + 2 * kl), d)
    ql, kl_, vl = jnp.split(seq_to_heads(qkv, sp_axis), [hq, hq + kl], axis=2)  # [b, S/R, hq + 2·k_loc, D]
    if segment_ids is not None:
        segment_ids = lax.all_gather(segment_ids, sp_axis, axis=1, tiled=True)  # [b, S/R]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    sinks = None if sinks is None else local_sinks(sinks, layout, sp_axis)
    o = ring_attention(ql, kl_, vl, axis_name=ring_axis, causal=causal, segment_ids=segment_ids, scale=scale,
                       order=order, kernel=kernel, window=window, sinks=sinks)
    return layout.ungather_out(heads_to_seq(o, sp_axis))
