"""Passkey evaluation of a run: its prompt format and filler, the settings checked, the rows through the mesh.

``passkey.py`` builds and scores samples; this module reads what a run needs (its tokenizer, its Hugging Face folder's
BOS/EOS and chat template, its held-out documents as filler), checks ``--lengths`` / ``--depths`` / ``--samples``
before anything runs, and feeds the packed rows to the per-token step (``token_scores.py``) one global batch of the
run's shape at a time, so the run's mesh and memory tools apply.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from ulysses_jax.data.pipeline import check_documents_per_row, eval_batches, process_rows, to_global
from ulysses_jax.data.tokenizers import make_tokenizer, tokenizer_conventions
from ulysses_jax.evaluation import passkey
from ulysses_jax.evaluation.token_scores import to_host

RESULT = "eval_passkey.json"


def parse_list(text: str, flag: str, kind=int) -> tuple:
    """``"a,b,c"`` -> a tuple of ``kind``; a bad item is one ``ValueError`` naming ``flag``."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    try:
        values = tuple(kind(t) for t in items)
    except ValueError:
        raise ValueError(f"{flag} {text!r} must be comma-separated {'integers' if kind is int else 'numbers'}, "
                         f"e.g. {'1024,2048' if kind is int else '0,0.5,1'}") from None
    if not values:
        raise ValueError(f"{flag} is empty; give comma-separated values")
    return values


def check_settings(lengths: tuple[int, ...], depths: tuple[float, ...], samples: int, digits: int,
                   seq_len: int) -> None:
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"--depths {d} must be in [0, 1] (0: the start of the context, 1: its end)")
    for n in lengths:
        if n > seq_len:
            raise ValueError(f"--lengths {n} is over the run's --seq-len {seq_len} (the row its mesh and memory "
                             f"tools were checked for); choose lengths up to {seq_len}, or train at that length")
        if n < 1:
            raise ValueError(f"--lengths {n} must be positive")
    if samples < 1:
        raise ValueError(f"--samples ({samples}) must be at least 1")
    if not 1 <= digits <= 18:
        raise ValueError(f"--passkey-digits ({digits}) must be in [1, 18]")


def default_lengths(seq_len: int, fixed: int) -> tuple[int, ...]:
    """The trained length and its halves down to 4x the non-filler tokens (at most 4 lengths)."""
    out = [seq_len]
    while len(out) < 4 and out[-1] // 2 >= 4 * fixed:
        out.append(out[-1] // 2)
    return tuple(sorted(out))


def prompt_format(record: dict, tokenizer_path: str | None) -> tuple[passkey.PromptFormat, str]:
    """The run's prompt format (plain, framed, or its chat template) and a word for it; checks its digits."""
    tokenizer = make_tokenizer(tokenizer_path)
    passkey.check_digits(tokenizer, tokenizer_path or "UTF-8 bytes")
    hf = (record.get("init_from_hf") or {}).get("path")
    if hf is None or not (pathlib.Path(hf) / "tokenizer.json").is_file():
        return passkey.PromptFormat.plain(tokenizer), "plain text"
    conventions = tokenizer_conventions(hf)
    if conventions.chat_template:
        from ulysses_jax.data.sft import SFTRenderer

        return passkey.PromptFormat.chat(tokenizer, SFTRenderer(hf).render), "the chat template of " + hf
    bos = conventions.bos_id if conventions.add_bos else None
    return passkey.PromptFormat.framed(tokenizer, bos, conventions.eos_id), "BOS/EOS framing of " + hf


def filler_tokens(fmt: passkey.PromptFormat, source: str, data_cfg, need: int, row: int = 0) -> np.ndarray:
    """The filler stream: the fixed text's tokens, or ``need`` tokens of the held-out documents (all processes read
    the same ones), read in rows of at least ``row`` tokens (the run's ``--seq-len``: an SFT record the run trained
    on, longer than ``need``, is never refused as longer than a row)."""
    if source == "fixed":
        return np.asarray(fmt.encode(passkey.FIXED_FILLER), np.int32)
    pieces, have = [], 0
    for b in eval_batches(data_cfg, seq_len=max(need, row, 16), global_batch=1, process_index=0, process_count=1):
        tokens = b["tokens"][b["segment_ids"] > 0]
        pieces.append(tokens)
        have += len(tokens)
        if have >= need:
            break
    if not have:
        raise ValueError("--passkey-filler data: the eval split has no tokens; use --passkey-filler fixed")
    return np.concatenate(pieces).astype(np.int32)


def passkey_rows(fmt: passkey.PromptFormat, filler: np.ndarray, *, lengths, depths, samples: int, seed: int,
                 digits: int, seq_len: int):
    """``(samples built, {(length, depth): sample indices}, rows, placements)``: every sample, packed into rows."""
    built, cells = [], {}
    for length in lengths:
        for depth in depths:
            cells[(length, depth)] = []
            for i in range(samples):
                cells[(length, depth)].append(len(built))
                built.append(passkey.build_sample(fmt, filler, length=length, depth=depth, index=i, seed=seed,
                                                  digits=digits))
    rows, placements = passkey.pack_samples(built, seq_len)
    return built, cells, rows, placements


def run_passkey(token_step, params, mesh, fmt: passkey.PromptFormat, filler: np.ndarray, *, lengths, depths,
                samples: int, seed: int, digits: int, seq_len: int, batch_size: int,
                doc_limit: int | None = None) -> dict:
    """``{"results": [{"length", "depth", "samples", "accuracy"}, ...], "rows", "keys"}``: every sample built,
    packed into rows of ``seq_len``, scored in global batches of ``batch_size`` rows. ``doc_limit``: the samples a
    row may hold for the step's cuDNN attention (more are refused, ``check_documents_per_row``)."""
    built, cells, rows, placements = passkey_rows(fmt, filler, lengths=lengths, depths=depths, samples=samples,
                                                  seed=seed, digits=digits, seq_len=seq_len)
    if doc_limit:
        check_documents_per_row(rows, doc_limit)
    n_rows = len(rows["tokens"])
    padded = -(-n_rows // batch_size) * batch_size
    rows = {k: np.concatenate([v, np.full((padded - n_rows, seq_len), -1 if k == "labels" else 0, np.int32)])
            for k, v in rows.items()}
    hits = np.zeros((padded, seq_len), bool)
    local = process_rows(mesh, batch_size, seq_len)
    for b in range(0, padded, batch_size):
        part = {k: v[b: b + batch_size][list(local)] for k, v in rows.items()}
        _, hit_BS = token_step(params, to_global(part, mesh, global_batch=batch_size, row_ids=local))
        hits[b: b + batch_size] = to_host(hit_BS)
    correct, share = passkey.score(hits, rows["labels"], built, placements, token_share=True)
    return {"results": passkey.accuracy_table(cells, correct, share), "rows": n_rows,
            "keys": [s.key for s in built[:3]]}


def write_result(run_dir, result: dict) -> pathlib.Path:
    path = pathlib.Path(run_dir) / RESULT
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def loop_metrics(result: dict) -> dict:
    """Passkey accuracy for ``metrics.jsonl``: overall, and per depth (at the one length the loop evaluates)."""
    res = result["results"]
    total = sum(r["samples"] for r in res)
    out = {"eval_passkey_accuracy": sum(r["accuracy"] * r["samples"] for r in res) / total}
    out.update({f"eval_passkey_depth_{r['depth']:g}": r["accuracy"] for r in res})
    return out
