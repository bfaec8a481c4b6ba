"""The segment-id convention of packed rows: what a document is, what padding is, and which rows are refused.

One rule, used by the data path (``data/pipeline.py``: its per-row count and its refusals, on the host, in NumPy) and by
the kernels (``kernels/cudnn_packed.py``: the ragged offsets cuDNN reads, in the program, in ``jnp``):

* a **document** is a run of equal ids: it starts at the row's first token and wherever the id differs from the
  token before. Id values carry no meaning beyond that, so ids counted from 0 work (a leading run of 0 is a document,
  and so is a run of 0 between two others);
* **padding** is the zeros after a row's last nonzero id (none in a row of zeros, which is one document); the
  kernels that compare ids give it an id of its own without a causal mask (``padding_apart``), where a leading
  run of 0s would otherwise see it;
* a row where one id names two separate runs (``[1, 1, 2, 2, 1, 1]``) is **refused**: the kernels that compare ids
  (``xla``, ``blockwise``, ``pallas``) would let its two runs attend to each other across the gap, cuDNN's ragged
  layout cannot express that, so neither meaning is taken. ``attention()`` raises on such rows when it sees their
  values, the data path refuses the batch before the step, and cuDNN's packed path turns the output NaN if one reaches
  it inside a program (``cudnn_packed.around_packed``).

The packer writes ids 1, 2, ... and zeros only at the end, so its rows are documents and padding by every reading.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _xp(segment_ids):
    return np if isinstance(segment_ids, np.ndarray) else jnp


def padding(segment_ids):
    """``[B, S]`` bool: the padding, the zeros after a row's last nonzero id (none in a row of zeros: one document)."""
    xp = _xp(segment_ids)
    pos = xp.arange(segment_ids.shape[1])
    last = xp.max(xp.where(segment_ids != 0, pos, -1), axis=1, keepdims=True)
    return (pos > last) & (last >= 0)


def padding_apart(segment_ids):
    """``segment_ids`` with its padding (``padding``) given an id no document has (-1): for the kernels that compare
    ids (``xla``, ``blockwise``, ``pallas``) without a causal mask, where a leading document of 0s would otherwise
    attend to the trailing zeros. A row's real tokens get the same output; the padding attends to itself."""
    return _xp(segment_ids).where(padding(segment_ids), -1, segment_ids)


def document_starts(segment_ids):
    """``[B, S]`` bool: the first token of each document (a run of equal ids; padding starts none)."""
    xp = _xp(segment_ids)
    first = xp.arange(segment_ids.shape[1]) == 0
    prev = xp.concatenate([segment_ids[:, :1], segment_ids[:, :-1]], axis=1)
    return ~padding(segment_ids) & (first | (segment_ids != prev))


def documents_per_row(segment_ids):
    """``[B]``: how many documents each row holds."""
    return _xp(segment_ids).sum(document_starts(segment_ids), axis=1)


def document_lengths(segment_ids) -> list[list[int]]:
    """Per row, the lengths of its documents in order (padding belongs to none). NumPy, on the host."""
    seg = np.asarray(segment_ids)
    starts, real = document_starts(seg), ~padding(seg)
    out = []
    for r in range(seg.shape[0]):
        first = np.flatnonzero(starts[r])
        end = int(real[r].sum())  # padding only trails: the real tokens are a prefix
        out.append(np.diff(np.append(first, end)).tolist())
    return out


def split_documents(segment_ids):
    """``[B]`` bool: rows in which one id names two separate runs (refused, see the module docstring). NumPy rows only:
    in a program, ``cudnn_packed`` finds them among the runs it lists."""
    seg = np.asarray(segment_ids)
    starts = document_starts(seg)
    out = np.zeros(seg.shape[0], bool)
    for r in range(seg.shape[0]):
        ids = seg[r][starts[r]]
        out[r] = len(np.unique(ids)) < len(ids)
    return out


def split_message(segment_ids) -> str | None:
    """One sentence naming the first refused row (``split_documents``), its id and where its runs start; None if no row
    is refused."""
    seg = np.asarray(segment_ids)
    bad = np.flatnonzero(split_documents(seg))
    if not len(bad):
        return None
    r = int(bad[0])
    starts = np.flatnonzero(document_starts(seg[r:r + 1])[0])
    ids = seg[r, starts]
    values, counts = np.unique(ids, return_counts=True)
    twice = values[counts > 1][0]
    where = ", ".join(str(int(p)) for p in starts[ids == twice][:3])
    return (f"row {r} uses segment id {int(twice)} for separate runs of tokens (starting at positions {where}); a "
            f"document's tokens must be contiguous: give each run its own id")


def check_segment_ids(segment_ids) -> None:
    """Raise ``ValueError`` (``split_message``) when ``segment_ids`` holds concrete values that some row refuses; traced
    values pass (the program cannot raise)."""
    if segment_ids is None or isinstance(segment_ids, jax.core.Tracer):
        return
    if isinstance(segment_ids, jax.Array) and not segment_ids.is_fully_addressable:
        return  # another process holds some rows; the data path checked them
    message = split_message(np.asarray(segment_ids))
    if message:
        raise ValueError(message)
