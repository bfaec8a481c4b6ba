"""Supervised fine-tuning documents: jsonl records -> tokens and the positions whose next-token label counts.

Records (one JSON object per line):
  {"prompt": "...", "completion": "..."}              ``[bos] + prompt + completion + [eos]``, loss on the
                                                      completion and the eos (bos when the tokenizer adds one)
  {"messages": [{"role": ..., "content": ...}, ...]}  the folder's chat template, loss on assistant turns only
  {"prompt": [messages], "completion": [messages]}    the chat template, loss on the completion's messages

Output per document: ``SFTExample(tokens, loss_mask)``, int32 and bool ``[T]``. ``loss_mask[t]`` says whether
the label of position ``t`` counts, and that label is the *next* token, ``tokens[t + 1]``: a position counts when
the token after it is a trained token (completion, assistant turn). So the last prompt token is the first
position that counts (it predicts the first completion token), and the last position never counts (no next
token in the document). ``labels()`` gives ``tokens[t + 1]`` where the mask is set and ``IGNORE`` elsewhere:
shifted per document, before packing and before the sequence is split over devices, as ``pipeline.py`` does.

Assistant turns. With ``{% generation %}`` ... ``{% endgeneration %}`` markers in the template (transformers'
convention for ``return_assistant_tokens_mask``), the marked text is trained. Without them (most templates),
assistant message ``i``'s text is what ``render(messages[:i + 1])`` adds to ``render(messages[:i],
add_generation_prompt=True)``: its content and the template's end-of-turn tokens (``<|im_end|>``, ``<|eot_id|>``)
plus whatever the template puts between turns; the header (``<|im_start|>assistant\\n``) is not trained. A
template that renders earlier turns differently once later ones follow (Qwen3 drops past reasoning) breaks that
prefix property and is refused with a message: add generation markers to it. A token is trained when any of its
characters is in trained text (offsets from tokenizer.json), as transformers' assistant masks map characters to
tokens: a generation prompt ending in a space (``"ASSISTANT: "``) merges it into the answer's first token. The
rendered text is tokenized without adding special tokens: the template writes bos itself, as ``apply_chat_template``
does.

Compared with TRL's ``SFTTrainer`` (its dataset-format docs): TRL names the same record shapes "prompt-completion"
(standard: strings; conversational: message lists) and "language modeling" (``{"text"}``, or ``{"messages"}``).
For prompt-completion TRL trains on the completion only by default (``completion_only_loss``), as here; for
``{"messages"}`` TRL trains on every token unless ``assistant_only_loss=True``, which needs the template's
``{% generation %}`` markers. Here ``{"messages"}`` always means assistant-only loss, with the markers when the
template has them and the prefix rule above when it does not; plain ``{"text"}`` documents are the ordinary
pretraining data of ``pipeline.py`` (loss on every token). TRL tokenizes ``prompt + completion`` in one piece; here the
prompt and completion are tokenized separately, so the boundary is exact (a merge across it cannot happen).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import re
from collections.abc import Iterator

import numpy as np

from ulysses_jax.data.tokenizers import TokenizerConventions, tokenizer_conventions

IGNORE = -1  # the same value as ulysses_jax.model.loss.IGNORE
ROLES = ("system", "developer", "user", "assistant", "tool")  # the roles chat templates know
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters that mark generation blocks while rendering
_MARKERS = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclasses.dataclass(frozen=True)
class SFTExample:
    tokens: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # bool [T]: loss_mask[t] = the label of position t, tokens[t + 1], counts

    def labels(self) -> np.ndarray:
        """int32 ``[T]``: ``tokens[t + 1]`` where ``loss_mask[t]``, else ``IGNORE`` (always at the last position)."""
        out = np.full(self.tokens.shape, IGNORE, np.int32)
        out[:-1] = np.where(self.loss_mask[:-1], self.tokens[1:], IGNORE)
        return out


def _from_targets(ids, targets) -> SFTExample:
    """``targets[t]``: token ``t`` is trained, i.e. the label of position ``t - 1`` counts."""
    tokens, targets = np.asarray(ids, np.int32), np.asarray(targets, bool)
    return SFTExample(tokens, np.append(targets[1:], False))


def _environment():
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # {% generation %}...{% endgeneration %}: wrap the output in marker characters
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return _OPEN + caller() + _CLOSE

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, sort_keys=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class SFTRenderer:
    """Renders SFT records with the tokenizer, BOS/EOS conventions and chat template of a Hugging Face folder.

    ``template_kwargs`` go to the chat template (e.g. ``{"enable_thinking": False}`` for Qwen3).
    """

    def __init__(self, path, *, template_kwargs: dict | None = None):
        import tokenizers

        self.conventions: TokenizerConventions = tokenizer_conventions(path)
        self.tokenizer = tokenizers.Tokenizer.from_file(self.conventions.tokenizer_json)
        self.template_kwargs = dict(template_kwargs or {})
        self._template = None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    # -- prompt / completion strings

    def prompt_completion(self, prompt: str, completion: str) -> SFTExample:
        c = self.conventions
        head = ([c.bos_id] if c.add_bos else []) + self.encode(prompt)
        tail = self.encode(completion) + ([c.eos_id] if c.eos_id is not None else [])
        return _from_targets(head + tail, [False] * len(head) + [True] * len(tail))

    # -- chat

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        """The chat template's text for ``messages`` (generation markers left in)."""
        if self._template is None:
            if not self.conventions.chat_template:
                raise ValueError(f"{pathlib.Path(self.conventions.tokenizer_json).parent} has no chat template; "
                                 f"use prompt/completion records, or a folder with one (chat_template.jinja, as "
                                 f"transformers 5 writes it, or tokenizer_config.json's chat_template)")
            import jinja2

            try:
                self._template = _environment().from_string(self.conventions.chat_template)
            except jinja2.TemplateError as e:
                raise ValueError(f"the chat template of {self.conventions.tokenizer_json} does not compile: "
                                 f"{e}") from None
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.conventions.bos_token or "",
                                         eos_token=self.conventions.eos_token or "", **self.template_kwargs)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template refused these messages: {e}") from None

    def _tokenize_spans(self, text: str, spans: list[tuple[int, int]]) -> SFTExample:
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        offsets = np.asarray(enc.offsets, np.int64).reshape(-1, 2)
        targets = np.zeros(len(enc.ids), bool)
        for a, b in spans:  # any character in the span: " hello" after a prompt ending in a space is the answer's
            targets |= (offsets[:, 0] < b) & (offsets[:, 1] > a)
        return _from_targets(enc.ids, targets)

    def conversation(self, messages: list[dict], *, completion_from: int | None = None) -> SFTExample:
        """Loss on assistant messages, or with ``completion_from`` on messages ``[completion_from:]``."""
        full = self.render(messages)
        if _MARKERS.search(self.conventions.chat_template or "") and completion_from is None:
            spans, text, pos = [], [], 0
            for piece in re.split(f"([{_OPEN}{_CLOSE}])", full):
                if piece == _OPEN:
                    spans.append([pos, None])
                elif piece == _CLOSE:
                    spans[-1][1] = pos
                else:
                    text.append(piece)
                    pos += len(piece)
            return self._tokenize_spans("".join(text), [tuple(s) for s in spans])
        def unmarked(text: str) -> str:  # markers, but a prompt/completion split was asked for: drop them everywhere
            return text.replace(_OPEN, "").replace(_CLOSE, "")

        full = unmarked(full)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"] if completion_from is None else [
            completion_from]
        spans = []
        for i in turns:
            before = unmarked(self.render(messages[:i], add_generation_prompt=True))
            upto = full if completion_from is not None else unmarked(self.render(messages[: i + 1]))
            if not (full.startswith(upto) and upto.startswith(before)):
                raise ValueError(
                    f"the chat template renders message {i} ({messages[i]['role']}) differently once later messages "
                    f"follow, so its tokens cannot be found; add {{% generation %}} markers to the template")
            spans.append((len(before), len(upto)))
        return self._tokenize_spans(full, spans)

    # -- records

    def record(self, record: dict) -> SFTExample:
        """One jsonl record (see the module doc) -> ``SFTExample``; a malformed record raises ``ValueError``."""
        if not isinstance(record, dict):
            raise ValueError(f"a record must be a JSON object, not {type(record).__name__}")
        if "messages" in record:
            messages = _check_messages(record["messages"], "messages")
            if not any(m["role"] == "assistant" for m in messages):
                raise ValueError("messages has no assistant message, so nothing would be trained")
            return self.conversation(messages)
        prompt, completion = record.get("prompt"), record.get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            return self.prompt_completion(prompt, completion)
        if isinstance(prompt, list) and isinstance(completion, list):
            prompt, completion = _check_messages(prompt, "prompt"), _check_messages(completion, "completion")
            return self.conversation(prompt + completion, completion_from=len(prompt))
        raise ValueError(f"a record needs string or message-list 'prompt' and 'completion', or 'messages'; "
                         f"got keys {sorted(record)}")


def _check_messages(messages, key: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{key} must be a non-empty list of {{'role', 'content'}} messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{key}[{i}] must be an object with string 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise ValueError(f"{key}[{i}] has role {m['role']!r}; use one of {', '.join(ROLES)}")
        if _OPEN in m["content"] or _CLOSE in m["content"]:
            raise ValueError(f"{key}[{i}] contains the private-use characters U+E000/U+E001; remove them")
    return messages


def read_jsonl(path, renderer: SFTRenderer) -> Iterator[SFTExample]:
    """The documents of an SFT ``.jsonl`` file, in order; a bad line raises ``ValueError`` naming ``file:line``."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield renderer.record(json.loads(line))
            except (ValueError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}:{n}: {e}") from None
