"""Training data through Grain: documents -> tokens -> packed rows -> this process's part of a global batch.

Pipeline (each step a Grain dataset, so the iterator state is Grain's and a resumed run continues exactly):
  sources         ``--data`` files and directories (``.txt/.md/.py`` one document each, ``.jsonl`` lines, ``.parquet``
                  rows; see ``sources.py`` for the formats), or by default the Python standard library's own
                  source files (nothing to download). ``validate_sources`` reads and checks them all once, streaming,
                  before anything is written; its index holds numpy arrays, never a Python object per document.
  split           a document is held out for eval when a 64-bit hash of its *text* falls below ``eval_fraction``: the
                  split is the same however a path is written, on every machine, and a text that occurs twice is on
                  one side only. With ``eval_paths`` (``--eval-data``) the eval split is all of those documents instead;
                  training still leaves out its held-out fraction (``eval_fraction=0``: train on everything).
  order           train: shuffled by ``seed`` (a new order each epoch), repeated forever; eval: one pass, in order.
  row streams     row ``r`` of every global batch of ``B`` rows reads the documents at positions ``r, r + B, ...`` of
                  that order and packs them on its own; a process builds only the streams of its rows. The data
                  position is therefore kept per global row: a run resumes on another mesh or number of processes.
                  Packed rows are shuffled again in a window (``shuffle_window`` rows over the whole batch).
  tokenize        UTF-8 bytes (vocab 256) or a Hugging Face ``tokenizer.json``; runs in Grain's reader threads. With
                  ``frame`` (``--init-from-hf``) a document is ``[bos] + text + [eos]`` as the folder's model was
                  trained; with ``format="sft"`` each record is rendered by ``sft.py`` into tokens and a loss
                  mask, carried through packing: a label whose mask is 0 (prompt, non-assistant turn) is ``IGNORE``.
  pack_rows       text documents cut into pieces of at most ``seq_len`` tokens (an SFT record never is: refused or
                  dropped, ``lengths.py``), first-fit packed into rows of exactly
                  ``seq_len`` tokens (``grain.experimental.FirstFitPackIterDataset``), labels shifted per row.
  batch           this process's ``global_batch // process_count`` rows; ``to_global`` makes global ``[B, S]`` arrays.

A batch is a dict of int32 ``[rows, seq_len]`` arrays:
  tokens       token ids; 0 at padding
  segment_ids  1, 2, ... for the document pieces of a row, in order; 0 = padding (only at the row's end)
  positions    0, 1, ... restarting at each piece
  labels       ``tokens[t + 1]`` when ``t + 1`` is in the same piece, else ``IGNORE`` (a piece's last token, padding).
               Shifted on the whole row before the sequence split, so the last token of an ``sp`` shard keeps its
               target (the first token of the next shard). A piece cut from a long document starts a new segment.

For the job: ``validate_sources(cfg)`` (every data and tokenizer problem, one ``ValueError`` naming the flag, before
the run directory exists), ``describe_sources(cfg)`` (what to record in the run, content fingerprints included) and
``sources_differ(recorded, current)`` (why other data is not the run's data).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ulysses_jax.data.documents import IGNORE, DataConfig, Split, document_encoder, split_documents
from ulysses_jax.data.sources import fingerprint
from ulysses_jax.data.tokenizers import make_tokenizer
from ulysses_jax.kernels.segments import documents_per_row, split_message
from ulysses_jax.parallel.mesh import DATA, FSDP, SEQ, SP

KEYS = ("tokens", "labels", "segment_ids", "positions")

# ---------------------------------------------------------------------------------------------- packing


def next_token_labels(tokens: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
    """``labels[..., t] = tokens[..., t + 1]`` within a segment; ``IGNORE`` at a segment's end and at padding."""
    labels = np.full(tokens.shape, IGNORE, np.int32)
    same = (segment_ids[..., 1:] == segment_ids[..., :-1]) & (segment_ids[..., :-1] > 0)
    labels[..., :-1] = np.where(same, tokens[..., 1:], IGNORE)
    return labels


class _Pieces(grain.experimental.FlatMapTransform):
    """A token array (or ``{"tokens", "loss_mask"}``) -> ``{"tokens": piece, ...}`` for consecutive pieces of at most
    ``seq_len`` tokens."""

    max_fan_out = 1  # not used by FlatMapIterDataset

    def __init__(self, seq_len: int, max_empty_run: int | None, overlong: str = "refuse"):
        self.seq_len, self.max_empty_run, self._empty_run, self.overlong = seq_len, max_empty_run, 0, overlong

    def flat_map(self, doc):
        doc = {k: np.asarray(v, np.int32) for k, v in (doc if isinstance(doc, dict) else {"tokens": doc}).items()}
        tokens = doc["tokens"]
        over = "loss_mask" in doc and len(tokens) > self.seq_len  # an SFT record is never split (data/lengths.py)
        self._empty_run = 0 if len(tokens) and not over else self._empty_run + 1
        if self.max_empty_run is not None and self._empty_run > self.max_empty_run:
            raise ValueError(
                f"{self._empty_run} documents in a row have no tokens; check --tokenizer and --data-field"
                + (" (or raise --seq-len: SFT records longer than it are dropped)" if over else "")
            )
        if over:
            if self.overlong == "drop":
                return []
            raise ValueError(f"an SFT record of {len(tokens)} tokens is longer than --seq-len {self.seq_len}; raise "
                             f"--seq-len, or leave such records out with --sft-overlong drop")
        return [{k: v[i : i + self.seq_len] for k, v in doc.items()} for i in range(0, len(tokens), self.seq_len)]


def _finish_row(row: dict) -> dict:
    tokens, segment_ids = row["tokens"].astype(np.int32), row["tokens_segment_ids"].astype(np.int32)
    labels = next_token_labels(tokens, segment_ids)
    if "loss_mask" in row:  # SFT: only the labels of trained tokens count (sft.SFTExample.loss_mask; 0 at padding)
        labels = np.where(row["loss_mask"] > 0, labels, IGNORE).astype(np.int32)
    return {
        "tokens": tokens,
        "labels": labels,
        "segment_ids": segment_ids,
        "positions": row["tokens_positions"].astype(np.int32),
    }


def pack_rows(
    docs: grain.IterDataset,
    seq_len: int,
    *,
    bins: int = 16,
    seed: int = 0,
    shuffle: bool = False,
    max_empty_run: int | None = None,
    masked: bool = False,
    overlong: str = "refuse",
) -> grain.IterDataset:
    """1-D token arrays of any length -> rows (dicts of int32 ``[seq_len]``: see the module doc).

    ``masked``: documents are ``{"tokens", "loss_mask"}`` (SFT): a label counts only where its position's mask is set.

    Text documents longer than ``seq_len`` are cut into ``seq_len`` pieces, each its own segment (Grain's packer
    rejects longer ones); an SFT record longer than that raises, or with ``overlong="drop"`` is left out. ``bins``
    rows are filled first-fit; ``shuffle`` permutes them by ``seed``.
    ``max_empty_run``: raise after that many token-less documents in a row (a repeated empty corpus never ends).
    """
    pieces = grain.experimental.FlatMapIterDataset(docs, _Pieces(seq_len, max_empty_run, overlong))
    rows = grain.experimental.FirstFitPackIterDataset(
        pieces, length_struct={"tokens": seq_len, **({"loss_mask": seq_len} if masked else {})}, num_packing_bins=bins,
        seed=seed, shuffle_bins=shuffle,
    )
    return rows.map(_finish_row)


# ---------------------------------------------------------------------------------------------- batches


def _empty_rows(n: int, seq_len: int) -> dict[str, np.ndarray]:
    rows = {k: np.zeros((n, seq_len), np.int32) for k in KEYS}
    rows["labels"][:] = IGNORE
    return rows


class BatchIterator:
    """This process's rows of each global batch: ``global_batch // process_count`` packed rows per ``next``.

    Row streams: row ``r`` of every global batch (``r = 0 .. global_batch - 1``) comes from a stream of its own, the
    documents at positions ``r, r + B, r + 2B, ...`` of the split's order (``B = global_batch``), tokenized and packed
    on their own. Process ``p`` builds the streams of its rows only (``p * B/P .. (p + 1) * B/P - 1``), so the data
    position belongs to the global rows, not to the processes: a checkpoint resumes on any number of processes that
    divides the batch, and on any mesh. Within one pass over the documents, rows (so processes) read disjoint
    documents; consecutive pieces of a long document go to one row's consecutive steps, never into one batch.

    ``split="train"``: documents shuffled by ``seed`` (anew each epoch), repeated forever. ``split="eval"`` (or
    ``"held_out"``): one pass in corpus order; a row whose stream has run out is a padding row (all ``IGNORE``), and
    iteration stops when every stream of this process has. ``get_state`` / ``set_state``: every row's Grain iterator
    state plus the settings it belongs to (a fingerprint of the split's documents included), JSON-serialisable;
    ``merge_states`` joins the states of several processes.
    """

    def __init__(
        self,
        cfg: DataConfig,
        *,
        seq_len: int,
        global_batch: int,
        seed: int,
        split: Split = "train",
        process_index: int | None = None,
        process_count: int | None = None,
        row_ids: Sequence[int] | None = None,
    ):
        pi = jax.process_index() if process_index is None else process_index
        pc = jax.process_count() if process_count is None else process_count
        if seq_len < 1 or global_batch < 1:
            raise ValueError(f"--seq-len ({seq_len}) and --batch-size ({global_batch}) must be positive")
        if pc < 1 or not 0 <= pi < pc:
            raise ValueError(f"process index {pi} must be in [0, {pc}) (the number of processes)")
        if row_ids is None and global_batch % pc:
            raise ValueError(
                f"--batch-size ({global_batch}) must be divisible by the number of processes ({pc}); "
                f"choose a multiple of {pc}"
            )
        if row_ids is not None and (not row_ids or any(not 0 <= r < global_batch for r in row_ids)):
            raise ValueError(f"row_ids {list(row_ids)} must be rows of the global batch of {global_batch}")
        # rows of the global batch this process reads: its share, or what its devices hold (process_rows: processes
        # that share rows, when a ring or sp group spans hosts, read the same rows)
        self.row_ids = range(pi * (global_batch // pc), (pi + 1) * (global_batch // pc)) if row_ids is None \
            else tuple(row_ids)
        self.cfg, self.seq_len, self.rows, self.global_batch = cfg, seq_len, len(self.row_ids), global_batch
        self.process_index, self.process_count = pi, pc
        self.tokenizer = make_tokenizer(cfg.tokenizer)
        index, docs = split_documents(cfg, split)
        train = split == "train"
        order = grain.MapDataset.source(docs)
        if train:
            order = (order.shuffle(seed % 2**32) if cfg.shuffle else order).repeat(None)
        per_row = -(-len(docs) // global_batch)  # documents of one row in one pass
        window = cfg.shuffle_window // global_batch if train and cfg.shuffle else 0
        threads = max(1, cfg.read_threads // self.rows) if cfg.read_threads else 0
        options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=max(1, cfg.prefetch // self.rows))
        encode = document_encoder(cfg)
        self._streams = []
        for r in self.row_ids:
            tokens = order[r::global_batch].map(lambda d: encode(index.text(int(d)))).to_iter_dataset(options)
            rows = pack_rows(
                tokens, seq_len, bins=cfg.pack_bins, seed=(seed + r) % 2**32, shuffle=train and cfg.shuffle,
                max_empty_run=2 * per_row if train else None,  # longer: no document has a token (runs span <= 2 epochs)
                masked=cfg.format == "sft", overlong=cfg.sft_overlong,
            )
            if window > 1:
                rows = grain.experimental.WindowShuffleIterDataset(rows, window_size=window, seed=(seed + r) % 2**32)
            self._streams.append(rows.__iter__())
        self._done = [False] * self.rows
        self._settings = dict(
            split=split, seq_len=seq_len, global_batch=global_batch, seed=seed, documents=len(docs),
            fingerprint=fingerprint(index.digest[docs]), vocab_size=self.vocab_size,
        )  # fmt: skip

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        out = _empty_rows(self.rows, self.seq_len)
        for i, stream in enumerate(self._streams):
            if self._done[i]:
                continue
            try:
                row = next(stream)
            except StopIteration:
                self._done[i] = True
                continue
            for k in KEYS:
                out[k][i] = row[k]
        if all(self._done):
            raise StopIteration
        return out

    def get_state(self) -> dict:
        """This process's rows' positions (``{"rows": {row: grain state}}``) and the settings they belong to."""
        return {"rows": {str(r): it.get_state() for r, it in zip(self.row_ids, self._streams)}, **self._settings}

    def set_state(self, state: dict) -> None:
        for key, value in self._settings.items():
            if state.get(key) != value:
                what, fix = _RESUME[key]
                raise ValueError(
                    f"the data position was saved with {what} {state.get(key)!r} but this run has {value!r}; {fix}"
                )
        rows = state.get("rows", {})
        missing = [r for r in self.row_ids if str(r) not in rows]
        if missing:
            raise ValueError(
                f"the data position holds rows {sorted(map(int, rows))} of the batch but this process reads rows "
                f"{list(self.row_ids)}; the checkpoint was written by another version of ulysses-jax"
            )
        for r, it in zip(self.row_ids, self._streams):
            it.set_state(rows[str(r)])


def merge_states(states: list[dict]) -> dict:
    """The data position of the whole batch from every process's ``get_state()``."""
    rows = {}
    for s in states:
        rows.update(s["rows"])
    return {**states[0], "rows": dict(sorted(rows.items(), key=lambda kv: int(kv[0])))}


_SAME_DATA = "resume with the same --data, --data-field and --eval-fraction (and files unchanged)"
_RESUME = {  # iterator setting -> (what it is, how to resume), for set_state's refusals
    "split": ("split", "resume a training iterator"),
    "seq_len": ("--seq-len", "resume with the same --seq-len"),
    "global_batch": ("--batch-size", "resume with the same --batch-size"),
    "seed": ("--seed", "resume with the same --seed"),
    "documents": ("training documents", _SAME_DATA),
    "fingerprint": ("training data fingerprint", _SAME_DATA),
    "vocab_size": ("tokenizer vocabulary", "resume with the same --tokenizer"),
}


def eval_batches(
    cfg: DataConfig,
    *,
    seq_len: int,
    global_batch: int,
    max_batches: int | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
    split: Split = "eval",
    row_ids: Sequence[int] | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """One deterministic pass over the eval split: local batches, at most ``max_batches``.

    The eval split is ``cfg.eval_paths``' documents when given, else the held-out ones; ``split="held_out"``: the
    held-out documents either way.

    With several processes every one must run the same number of steps: ``max_batches`` is then required, and a
    process whose documents run out yields padding batches (all labels ``IGNORE``) up to it.
    """
    it = BatchIterator(
        cfg, seq_len=seq_len, global_batch=global_batch, seed=0, split=split,
        process_index=process_index, process_count=process_count, row_ids=row_ids,
    )  # fmt: skip
    if max_batches is None and it.process_count > 1:
        raise ValueError(
            f"eval over {it.process_count} processes needs a batch limit (--max-batches N), so that every process "
            "runs the same number of steps"
        )

    def gen():
        n = 0
        for batch in it:
            if max_batches is not None and n >= max_batches:
                return
            yield batch
            n += 1
        while it.process_count > 1 and n < max_batches:
            yield _empty_rows(it.rows, seq_len)
            n += 1

    return gen()


def check_documents_per_row(batch: dict[str, np.ndarray], limit: int | None) -> None:
    """Raise ``ValueError`` (one sentence: the row, the value, the fix) when a row uses one segment id for two separate
    runs (refused by every kernel: ``kernels/segments.py``), or, with ``limit`` (cuDNN's packed attention runs the
    step), holds more than ``limit`` documents, which the program compiled for that bound cannot describe. Documents
    and padding are counted by the kernels' own rule (``kernels/segments.py``)."""
    seg = np.asarray(batch["segment_ids"])
    message = split_message(seg)
    if message:
        raise ValueError(message)
    if limit is None:
        return
    worst = int(documents_per_row(seg).max(initial=0))
    if worst > limit:
        raise ValueError(f"a row holds {worst} documents, more than --attn-max-documents {limit} lets cuDNN's packed "
                         f"attention describe; raise --attn-max-documents (its workspace grows with it) or use "
                         f"--attention pallas")


def check_eval_documents(cfg, seq_len: int, global_batch: int, max_batches: int | None, limit: int, what: str) -> None:
    """``check_documents_per_row`` over the eval batches ``what`` reads, before it runs (its message names it)."""
    for local in eval_batches(cfg, seq_len=seq_len, global_batch=global_batch, max_batches=max_batches):
        try:
            check_documents_per_row(local, limit)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None


def process_rows(mesh: jax.sharding.Mesh, global_batch: int, seq_len: int) -> tuple[int, ...]:
    """The rows of the global ``[global_batch, seq_len]`` batch that this process's devices hold (whole rows, or parts
    of their sequence when a ring or sp group spans hosts): the rows it must read."""
    sharding = NamedSharding(mesh, P((DATA, FSDP), SEQ))
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map((global_batch, seq_len)).values():
        rows.update(range(global_batch)[index[0]])
    return tuple(sorted(rows))


def to_global(batch: dict[str, np.ndarray], mesh: jax.sharding.Mesh, *, global_batch: int | None = None,
              row_ids: Sequence[int] | None = None) -> dict[str, jax.Array]:
    """This process's ``[rows, S]`` arrays -> global ``[B, S]`` arrays on ``mesh``.

    Sharded ``P(("data", "fsdp"), ("ring", "sp"))``: the batch over ``data x fsdp``, the sequence over ``ring x sp``.
    Without ``row_ids``: each process holds its share of whole rows (``B = rows * process_count``). With ``row_ids``
    (``process_rows``) and ``global_batch``: the local rows are those global rows, and each device takes its part of
    them, so processes that share rows (a ring across hosts) each give their devices their part of the sequence.
    """
    sharding = NamedSharding(mesh, P((DATA, FSDP), SEQ))
    out = {}
    for key, local in batch.items():
        rows, seq = local.shape
        if row_ids is not None:
            if global_batch is None or len(row_ids) != rows:
                raise ValueError(f"to_global: {rows} local rows for row_ids {list(row_ids)} of a global batch of "
                                 f"{global_batch}")
            where = {r: i for i, r in enumerate(row_ids)}

            def part(index, local=local, where=where):
                picked = [where[r] for r in range(global_batch)[index[0]]]
                return local[picked][:, index[1]]

            out[key] = jax.make_array_from_callback((global_batch, seq), sharding, part)
            continue
        shape = (rows * jax.process_count(), seq)
        if shape[0] % (mesh.shape[DATA] * mesh.shape[FSDP]):
            raise ValueError(
                f"--batch-size ({shape[0]}) must be divisible by --mesh.data x --mesh.fsdp "
                f"({mesh.shape[DATA] * mesh.shape[FSDP]})"
            )
        if seq % mesh.shape[SP]:
            raise ValueError(f"--seq-len ({seq}) must be divisible by --mesh.sp ({mesh.shape[SP]})")
        out[key] = jax.make_array_from_process_local_data(sharding, local, shape)
    return out
