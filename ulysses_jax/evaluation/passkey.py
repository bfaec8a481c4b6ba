"""Passkey retrieval at length: synthetic samples, packed rows that keep samples apart, and the teacher-forced scorer.

A sample of ``length`` tokens is ``prefix + haystack + question + key + tail``. The haystack is filler (a fixed text,
or the run's held-out documents) with a needle inside: ``"The pass key is <key>. Remember it. <key> is the pass
key."``. With ``depth`` d the needle starts ``round(d * F)`` tokens into the haystack, ``F`` being the filler's length
(0: the haystack's first token, 1: the needle ends where the question begins). The key is a random number of
``digits`` digits (first digit not 0) drawn from ``(seed, length, depth, i)``, so a seed gives the same samples
everywhere. Pieces are tokenized on their own and joined as token ids, so positions are exact.

Prompt formats: plain text (bytes or a ``tokenizer.json``): the question is ``"\nWhat is the pass key? The pass key
is "``. A run started from a Hugging Face folder frames the sample as it framed documents (BOS/EOS); with a chat
template the haystack and the question are the user's message and ``"The pass key is <key>."`` the assistant's.

Scoring: one forward pass per row (all samples of a row together, each its own segment: positions restart and
attention never crosses samples), under teacher forcing; a sample is right when the greedy prediction of every token
of the answer's key is that token (``token_scores.greedy_scores``). No decoding loop.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ulysses_jax.data.documents import IGNORE
from ulysses_jax.data.pipeline import next_token_labels

FIXED_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = ("The pass key is ", ". Remember it. ", " is the pass key. ")
QUESTION = "\nWhat is the pass key? The pass key is "
_HAY, _KEY = "\x02HAYSTACK\x02", "\x02KEY\x02"


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """Token ids around the haystack and the key: ``prefix + haystack + question + key + tail``."""

    encode: object  # text -> int32 ids (no special tokens added)
    prefix: tuple[int, ...] = ()
    question: tuple[int, ...] = ()
    tail: tuple[int, ...] = ()

    @classmethod
    def plain(cls, tokenizer) -> PromptFormat:
        return cls(tokenizer.encode, (), _ids(tokenizer.encode(QUESTION)), _ids(tokenizer.encode(".")))

    @classmethod
    def framed(cls, tokenizer, bos_id: int | None, eos_id: int | None) -> PromptFormat:
        """As a run from a Hugging Face folder without a chat template read documents: ``[bos] + text + [eos]``."""
        return cls(tokenizer.encode, () if bos_id is None else (bos_id,), _ids(tokenizer.encode(QUESTION)),
                   _ids(tokenizer.encode(".")) + (() if eos_id is None else (eos_id,)))

    @classmethod
    def chat(cls, tokenizer, render) -> PromptFormat:
        """``render(messages) -> text``: a chat template. The rendered text is cut at the haystack and the key."""
        text = render([{"role": "user", "content": _HAY + "\nWhat is the pass key?"},
                       {"role": "assistant", "content": "The pass key is " + _KEY + "."}])
        if text.count(_HAY) != 1 or text.count(_KEY) != 1 or text.index(_HAY) > text.index(_KEY):
            raise ValueError("the run's chat template does not keep a user message and an assistant reply in order; "
                             "evaluate passkey on a run without a chat template")
        before, rest = text.split(_HAY)
        middle, after = rest.split(_KEY)
        enc = tokenizer.encode
        return cls(enc, _ids(enc(before)), _ids(enc(middle)), _ids(enc(after)))

    def needle(self, key_ids: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
        """The needle's ids and where its first key starts in it."""
        a, b, c = (_ids(self.encode(t)) for t in NEEDLE)
        return a + key_ids + b + key_ids + c, len(a)

    def fixed_tokens(self, digits: int) -> int:
        """Tokens of a sample that are not filler (keys of ``digits`` digits written as 9s: an upper bound for
        tokenizers that merge digits)."""
        key = _ids(self.encode("9" * digits))
        return len(self.prefix) + len(self.needle(key)[0]) + len(self.question) + len(key) + len(self.tail)


def _ids(x) -> tuple[int, ...]:
    return tuple(int(i) for i in np.asarray(x).reshape(-1))


def check_digits(tokenizer, where: str) -> None:
    """``ValueError`` unless the tokenizer writes every digit and reads it back (a key must be writable)."""
    for text in ("0123456789", "9876543210"):
        ids = tokenizer.encode(text)
        back = tokenizer.decode(ids) if len(ids) else ""
        if back.replace(" ", "") != text:
            raise ValueError(f"the run's tokenizer ({where}) cannot write digits ({text!r} reads back as {back!r}); "
                             f"passkey needs a tokenizer that writes numbers: evaluate --by-position only")


@dataclasses.dataclass(frozen=True)
class Sample:
    tokens: np.ndarray  # int32 [length]
    key: str
    answer: tuple[int, int]  # [start, end) of the answer's key tokens (the scored ones)
    needle_start: int  # first token of the needle
    haystack: tuple[int, int]  # [start, end) of the haystack
    filler: int  # filler tokens in the haystack


def build_sample(fmt: PromptFormat, filler_ids: np.ndarray, *, length: int, depth: float, index: int, seed: int,
                 digits: int = 5) -> Sample:
    """Sample ``index`` of (``length``, ``depth``): see the module doc. ``filler_ids``: a token stream (any length
    >= 1); the haystack takes a window of it (repeated if short) starting at a seeded offset."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"--depths {depth} must be in [0, 1] (0: the start of the context, 1: its end)")
    rng = np.random.default_rng([seed, length, round(depth * 10**6), index])
    key = str(int(rng.integers(10 ** (digits - 1), 10**digits)))
    key_ids = _ids(fmt.encode(key))
    needle, _ = fmt.needle(key_ids)
    n_filler = length - len(fmt.prefix) - len(needle) - len(fmt.question) - len(key_ids) - len(fmt.tail)
    if n_filler < 0:
        raise ValueError(f"--lengths {length} is too short for a passkey sample (at least "
                         f"{fmt.fixed_tokens(digits)} tokens with this tokenizer); choose longer lengths")
    stream = np.asarray(filler_ids, np.int32).reshape(-1)
    start = int(rng.integers(len(stream)))
    filler = np.resize(np.roll(stream, -start), n_filler) if n_filler else np.zeros(0, np.int32)
    cut = round(depth * n_filler)
    hay_start = len(fmt.prefix)
    answer_start = hay_start + n_filler + len(needle) + len(fmt.question)
    tokens = np.concatenate([np.asarray(x, np.int32) for x in (
        fmt.prefix, filler[:cut], needle, filler[cut:], fmt.question, key_ids, fmt.tail)])
    assert len(tokens) == length, (len(tokens), length)
    return Sample(tokens, key, (answer_start, answer_start + len(key_ids)), hay_start + cut,
                  (hay_start, hay_start + n_filler + len(needle)), n_filler)


# ------------------------------------------------------------------------------------ rows and scoring


@dataclasses.dataclass(frozen=True)
class Placement:
    sample: int  # index into the samples
    row: int
    offset: int  # the sample's first token in the row


def pack_samples(samples: list[Sample], row_len: int) -> tuple[dict[str, np.ndarray], list[Placement]]:
    """Samples -> rows of ``row_len`` tokens, in order, a new row when the next one does not fit. Each sample is its
    own segment (ids 1, 2, ... in a row; positions restart at 0; labels never cross a sample); padding has segment 0
    and no labels. Returns the ``[rows, row_len]`` arrays and where each sample went."""
    placements, row, used = [], 0, 0
    rows: list[list[tuple[int, Sample]]] = [[]]
    for i, s in enumerate(samples):
        if len(s.tokens) > row_len:
            raise ValueError(f"--lengths {len(s.tokens)} is over the evaluation row of {row_len} tokens (the run's "
                             f"--seq-len, what its mesh and memory tools were checked for); choose lengths up to "
                             f"{row_len}")
        if used + len(s.tokens) > row_len:
            rows.append([])
            row, used = row + 1, 0
        placements.append(Placement(i, row, used))
        rows[row].append((i, s))
        used += len(s.tokens)
    n = len(rows)
    out = {k: np.zeros((n, row_len), np.int32) for k in ("tokens", "segment_ids", "positions")}
    for r, members in enumerate(rows):
        at = 0
        for seg, (_, s) in enumerate(members, start=1):
            span = slice(at, at + len(s.tokens))
            out["tokens"][r, span] = s.tokens
            out["segment_ids"][r, span] = seg
            out["positions"][r, span] = np.arange(len(s.tokens))
            at += len(s.tokens)
    out["labels"] = next_token_labels(out["tokens"], out["segment_ids"])
    return out, placements


def score(hit_RS: np.ndarray, labels_RS: np.ndarray, samples: list[Sample], placements: list[Placement],
          *, token_share: bool = False):
    """Per sample: whether every key token of its answer was the greedy prediction (``hit`` at the label position
    before each key token: the token that predicts it). ``token_share``: also the share of its key tokens right."""
    correct, share = np.zeros(len(samples), bool), np.zeros(len(samples))
    for p in placements:
        a, b = samples[p.sample].answer
        where = np.arange(p.offset + a - 1, p.offset + b - 1)
        labels = labels_RS[p.row, where]
        assert (labels == samples[p.sample].tokens[a:b]).all() and (labels != IGNORE).all(), "key labels misplaced"
        correct[p.sample] = bool(hit_RS[p.row, where].all())
        share[p.sample] = float(hit_RS[p.row, where].mean())
    return (correct, share) if token_share else correct


def accuracy_table(samples_by_cell: dict[tuple[int, float], list[int]], correct: np.ndarray,
                   share: np.ndarray | None = None) -> list[dict]:
    """``[{"length", "depth", "samples", "accuracy"}, ...]`` from each (length, depth) cell's sample indices (with
    ``share``: ``key_token_accuracy`` too, the mean share of key tokens right, a finer signal for weak models)."""
    return [{"length": int(length), "depth": float(depth), "samples": len(idx),
             "accuracy": float(np.mean(correct[idx])),
             **({} if share is None else {"key_token_accuracy": float(np.mean(share[idx]))})}
            for (length, depth), idx in samples_by_cell.items()]
