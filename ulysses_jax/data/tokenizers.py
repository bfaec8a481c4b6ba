"""Tokenizers: UTF-8 bytes or a Hugging Face ``tokenizer.json``, and how a model folder's tokenizer frames a text.

``make_tokenizer(path)`` gives the tokenizer of ``--tokenizer`` (bytes when none); ``describe_tokenizer`` is what a
run records of it; ``tokenizer_conventions(folder)`` reads BOS/EOS, whether BOS is added, the stop ids and the chat
template from the folder's JSON files (``TokenizerConventions``), the framing that ``--init-from-hf`` and SFT
rendering use.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib

import numpy as np

from ulysses_jax.model.hf_config import read_json


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to load."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", "replace"), np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, np.uint8)).decode("utf-8", "replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library; no special tokens are added."""

    def __init__(self, path: str | pathlib.Path, tokenizer=None):
        import tokenizers

        self.path = str(path)
        self._tok = tokenizers.Tokenizer.from_file(self.path) if tokenizer is None else tokenizer
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def count(self, texts: list[str]) -> list[int]:
        """Tokens of each text (``encode``'s lengths), the batch tokenized in parallel."""
        return [len(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]


_SENTENCEPIECE_FIX = (
    "a Hugging Face tokenizer.json is needed: convert it (transformers' "
    "AutoTokenizer.from_pretrained(<its directory>).save_pretrained(<directory>) writes one) and pass that with "
    "--tokenizer"
)


def make_tokenizer(path: str | None) -> ByteTokenizer | HFTokenizer:
    """``None`` -> bytes; a ``tokenizer.json`` file, or a directory containing one -> ``HFTokenizer``.

    Every problem is one ``ValueError`` naming ``--tokenizer``: no such path, a directory without tokenizer.json, a
    sentencepiece ``tokenizer.model``, a file that cannot be read, is not JSON or is not a tokenizer.
    """
    if path is None:
        return ByteTokenizer()
    import tokenizers

    p = pathlib.Path(path).expanduser()
    if p.is_dir():
        if not (p / "tokenizer.json").is_file():
            if (p / "tokenizer.model").is_file():
                raise ValueError(f"--tokenizer {path} holds a sentencepiece tokenizer.model; {_SENTENCEPIECE_FIX}")
            raise ValueError(
                f"--tokenizer {path} is a directory without a tokenizer.json; pass the file with --tokenizer"
            )
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"--tokenizer {path} does not exist; pass a Hugging Face tokenizer.json with --tokenizer")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ValueError(
            f"--tokenizer {p} cannot be read ({e.strerror or e}); pass a readable tokenizer.json"
        ) from None
    if p.suffix == ".model" or raw[:1] == b"\x0a":  # a sentencepiece ModelProto starts with field 1 (its pieces)
        raise ValueError(f"--tokenizer {p} is a sentencepiece model; {_SENTENCEPIECE_FIX}")
    try:
        tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8-sig"))
    except Exception as e:  # tokenizers raises a bare Exception
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ValueError(
            f"--tokenizer {p} is not a Hugging Face tokenizer.json ({why}); pass the tokenizer.json of the model"
        ) from None
    return HFTokenizer(p, tok)


def tokenizer_folder(path: str | None, why: str) -> pathlib.Path:
    """The Hugging Face folder of ``--tokenizer`` (the folder itself, or the one holding its tokenizer.json)."""
    if path is None:
        raise ValueError(f"{why} needs the tokenizer of a Hugging Face model folder: give --init-from-hf DIR or "
                         f"--tokenizer DIR")
    p = pathlib.Path(path).expanduser()
    folder = p if p.is_dir() else p.parent
    if not (folder / "tokenizer.json").is_file() or (p.is_file() and p.name != "tokenizer.json"):
        raise ValueError(f"{why} needs a Hugging Face tokenizer folder (tokenizer.json beside tokenizer_config.json); "
                         f"--tokenizer {path} is not one: pass the model's folder")
    return folder


def describe_tokenizer(path: str | None) -> dict:
    """The tokenizer as the run should record it: resolved path, vocabulary size and a hash of the file."""
    tok = make_tokenizer(path)
    if path is None:
        return dict(path=None, kind="bytes", vocab_size=tok.vocab_size, fingerprint=None)
    p = pathlib.Path(tok.path).resolve()
    return dict(path=str(p), kind="tokenizer.json", vocab_size=tok.vocab_size,
                fingerprint=hashlib.blake2b(p.read_bytes(), digest_size=16).hexdigest())


# ---------------------------------------------------------------------------------------------- conventions


@dataclasses.dataclass(frozen=True)
class TokenizerConventions:
    """How a model folder's tokenizer frames text: read by ``tokenizer_conventions(path)``.

    ``add_bos``: the tokenizer puts ``bos`` in front of a text (``add_bos_token`` in tokenizer_config.json, else
    what tokenizer.json's post-processor does). ``eos``: tokenizer_config.json's ``eos_token`` (else
    generation_config.json's / config.json's first ``eos_token_id``): the token that ends a document.
    ``stop_ids``: every id generation stops at (generation_config.json). ``chat_template``: the Jinja template
    (chat_template.jinja, chat_template.json or tokenizer_config.json), or None.
    """

    tokenizer_json: str
    bos_token: str | None
    bos_id: int | None
    eos_token: str | None
    eos_id: int | None
    add_bos: bool
    stop_ids: tuple[int, ...]
    chat_template: str | None

    def frame(self, ids) -> np.ndarray:
        """A document as the model saw documents in training: ``[bos] + ids + [eos]`` (bos when ``add_bos``)."""
        head = [self.bos_id] if self.add_bos else []
        tail = [self.eos_id] if self.eos_id is not None else []
        return np.asarray(head + [int(i) for i in ids] + tail, np.int32)


def _token_text(value):
    return value.get("content") if isinstance(value, dict) else value


def _ids(value) -> list[int]:
    return [value] if isinstance(value, int) else [v for v in value or () if isinstance(v, int)]


def tokenizer_conventions(path) -> TokenizerConventions:
    import tokenizers

    folder = pathlib.Path(path).expanduser()
    tok_path = folder / "tokenizer.json"
    if not tok_path.is_file():
        raise ValueError(f"{folder} has no tokenizer.json; save the tokenizer with transformers' save_pretrained there")
    tok = tokenizers.Tokenizer.from_file(str(tok_path))
    tcfg = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    gen = read_json(folder / "generation_config.json") if (folder / "generation_config.json").is_file() else {}
    mcfg = read_json(folder / "config.json") if (folder / "config.json").is_file() else {}

    def token(key):
        text = _token_text(tcfg.get(f"{key}_token"))
        tid = tok.token_to_id(text) if text else None
        if text and tid is None:
            raise ValueError(f"{folder}/tokenizer_config.json: {key}_token {text!r} is not in tokenizer.json")
        if tid is None:
            ids = _ids(gen.get(f"{key}_token_id")) or _ids(mcfg.get(f"{key}_token_id"))
            tid = ids[0] if ids else None
            text = tok.id_to_token(tid) if tid is not None else None
        return text, tid

    (bos, bos_id), (eos, eos_id) = token("bos"), token("eos")
    if isinstance(tcfg.get("add_bos_token"), bool):
        add_bos = tcfg["add_bos_token"] and bos_id is not None
    else:
        first = [tok.encode("x", add_special_tokens=added).ids[:1] for added in (True, False)]
        add_bos = bos_id is not None and first[0] == [bos_id] != first[1]
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if (folder / "chat_template.json").is_file():
        template = read_json(folder / "chat_template.json").get("chat_template", template)
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    stop = _ids(gen.get("eos_token_id")) or _ids(mcfg.get("eos_token_id")) or _ids(eos_id)
    return TokenizerConventions(str(tok_path), bos, bos_id, eos, eos_id, bool(add_bos), tuple(stop), template)
