"""Passkey: the scorer on known logits (multi-token keys, keys at a row's very start and end), the sample builder's
depth, determinism, prompt formats, digits, and packed rows that never let a sample see another."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ulysses_jax.data.tokenizers import ByteTokenizer, HFTokenizer
from ulysses_jax.model.config import ModelConfig
from ulysses_jax.model.transformer import Transformer
from ulysses_jax.evaluation import passkey
from ulysses_jax.train.devices import MeshConfig, build_mesh
from ulysses_jax.train.step import state_shardings
from ulysses_jax.evaluation.token_scores import greedy_scores, make_token_step

BYTES = passkey.PromptFormat.plain(ByteTokenizer())


def _sample(tokens, answer):
    return passkey.Sample(np.asarray(tokens, np.int32), "k", answer, 0, (0, 0), 0)


def _scored(logits, rows, samples, placements):
    _, hit = greedy_scores(jnp.asarray(logits), jnp.asarray(rows["labels"]))
    return passkey.score(np.asarray(hit), rows["labels"], samples, placements)


def test_scorer_known_logits(seed):
    rng = np.random.default_rng(seed)
    V = 16
    samples = [
        _sample(rng.integers(1, V, 8), (1, 4)),  # a 3-token key from the sample's second token: row 0 at offset 0
        _sample(rng.integers(1, V, 10), (6, 10)),  # a 4-token key ending at the row's last token
        _sample(rng.integers(1, V, 12), (5, 8)),  # does not fit: row 1
        _sample(rng.integers(1, V, 5), (4, 5)),  # a 1-token key, last in row 1
    ]
    rows, placements = passkey.pack_samples(samples, 18)
    assert [(p.row, p.offset) for p in placements] == [(0, 0), (0, 8), (1, 0), (1, 12)]
    assert rows["segment_ids"][0].tolist() == [1] * 8 + [2] * 10 and rows["labels"][0, 17] == -1
    # logits whose argmax is the label everywhere: every key right
    logits = rng.normal(size=(2, 18, V)).astype(np.float32)
    r, t = np.nonzero(rows["labels"] >= 0)
    logits[r, t, rows["labels"][r, t]] = 10.0
    assert _scored(logits, rows, samples, placements).tolist() == [True] * 4
    # one wrong token: the first key token of sample 0 (predicted at position 0, the row's very start), the last of
    # sample 1 (predicted at position 16, the row's last label), the only one of sample 3; a non-key token of sample 2
    wrong = logits.copy()
    for row, pos in ((0, 0), (0, 16), (1, 15), (1, 8)):
        wrong[row, pos, (rows["labels"][row, pos] + 1) % V] = 20.0
    assert _scored(wrong, rows, samples, placements).tolist() == [False, False, True, False]
    _, hit = greedy_scores(jnp.asarray(wrong), jnp.asarray(rows["labels"]))
    _, share = passkey.score(np.asarray(hit), rows["labels"], samples, placements, token_share=True)
    np.testing.assert_allclose(share, [2 / 3, 3 / 4, 1.0, 0.0])
    table = passkey.accuracy_table({(18, 0.0): [0, 1], (18, 1.0): [2, 3]},
                                   _scored(wrong, rows, samples, placements))
    assert table == [{"length": 18, "depth": 0.0, "samples": 2, "accuracy": 0.0},
                     {"length": 18, "depth": 1.0, "samples": 2, "accuracy": 0.5}]
    # random logits: the scorer agrees with numpy's argmax over the key positions
    noisy = rng.normal(size=(2, 18, V)).astype(np.float32)
    noisy[r, t, rows["labels"][r, t]] += rng.choice([0.0, 5.0], size=len(r), p=[0.2, 0.8])
    expect = []
    for s, p in zip(samples, placements):
        where = np.arange(p.offset + s.answer[0] - 1, p.offset + s.answer[1] - 1)
        expect.append(bool((noisy[p.row, where].argmax(-1) == s.tokens[s.answer[0]:s.answer[1]]).all()))
    assert _scored(noisy, rows, samples, placements).tolist() == expect


@pytest.mark.parametrize("length", [160, 333, 1024])
def test_builder_puts_the_key_at_the_depth(length, seed):
    rng = np.random.default_rng(seed)
    filler = BYTES.encode(passkey.FIXED_FILLER)
    head = len(BYTES.encode(passkey.NEEDLE[0]))
    for i, depth in enumerate([0.0, 1.0, 0.5, *rng.random(4)]):
        s = passkey.build_sample(BYTES, filler, length=length, depth=float(depth), index=i, seed=seed)
        text = ByteTokenizer().decode(s.tokens)
        assert len(s.tokens) == length
        assert abs((s.needle_start - s.haystack[0]) - depth * s.filler) <= 0.5  # within one token (rounding)
        key_at = s.needle_start + head
        assert ByteTokenizer().decode(s.tokens[key_at: key_at + 5]) == s.key and len(s.key) == 5
        assert ByteTokenizer().decode(s.tokens[s.answer[0]: s.answer[1]]) == s.key
        assert text.endswith(passkey.QUESTION + s.key + ".")
        if depth == 0.0:
            assert s.needle_start == s.haystack[0] and text.startswith("The pass key is " + s.key)
        if depth == 1.0:
            needle_end = s.needle_start + len(BYTES.needle(tuple(BYTES.encode(s.key)))[0])
            assert needle_end == s.haystack[1] and text[: s.answer[0]].endswith("is the pass key. " + passkey.QUESTION)


def test_deterministic_for_a_seed():
    filler = BYTES.encode(passkey.FIXED_FILLER)

    def keys(seed):
        return [passkey.build_sample(BYTES, filler, length=256, depth=d, index=i, seed=seed)
                for d in (0.0, 0.5) for i in range(4)]

    a, b, c = keys(7), keys(7), keys(8)
    assert all((x.tokens == y.tokens).all() and x.key == y.key for x, y in zip(a, b))
    assert len({x.key for x in a}) == len(a)  # samples differ from each other
    assert [x.key for x in a] != [x.key for x in c]


def test_chat_format_and_multi_digit_tokens(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel
                                             .alphabet(), special_tokens=["<u>", "<a>", "<e>"])
    tok.train_from_iterator([passkey.FIXED_FILLER * 3, "12 34 56 78 90 1234 5678 " * 20, passkey.QUESTION], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path / "tokenizer.json")
    passkey.check_digits(hf, "test")

    def render(messages):
        return "".join(f"<{m['role'][0]}>{m['content']}<e>" for m in messages)

    fmt = passkey.PromptFormat.chat(hf, render)
    filler = hf.encode(passkey.FIXED_FILLER)
    s = passkey.build_sample(fmt, filler, length=200, depth=0.5, index=0, seed=1)
    assert len(s.tokens) == 200
    assert hf.decode(s.tokens[s.answer[0]: s.answer[1]]) == s.key
    hay = hf.decode(s.tokens[s.haystack[0]: s.haystack[1]])
    expect = render([{"role": "user", "content": hay + "\nWhat is the pass key?"},
                     {"role": "assistant", "content": f"The pass key is {s.key}."}])
    assert tok.decode(s.tokens.tolist(), skip_special_tokens=False) == expect
    with pytest.raises(ValueError, match="does not keep a user message and an assistant reply"):
        passkey.PromptFormat.chat(hf, lambda messages: messages[0]["content"])


def test_tokenizer_without_digits_and_short_lengths_refused():
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "alpha": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    with pytest.raises(ValueError, match=r"cannot write digits \('0123456789' reads back as '\[UNK\]'\)"):
        passkey.check_digits(HFTokenizer("w", tokenizer=tok), "w")
    passkey.check_digits(ByteTokenizer(), "bytes")
    with pytest.raises(ValueError, match="--lengths 50 is too short for a passkey sample"):
        passkey.build_sample(BYTES, np.ones(3, np.int32), length=50, depth=0.5, index=0, seed=0)
    with pytest.raises(ValueError, match=r"--depths 1.5 must be in \[0, 1\]"):
        passkey.build_sample(BYTES, np.ones(3, np.int32), length=500, depth=1.5, index=0, seed=0)
    s = passkey.build_sample(BYTES, np.ones(3, np.int32), length=200, depth=0.5, index=0, seed=0)
    with pytest.raises(ValueError, match="--lengths 200 is over the evaluation row of 128 tokens"):
        passkey.pack_samples([s], 128)


def test_packed_rows_never_let_a_sample_see_another(seed):
    """A sample's scores are the same whatever shares its row, and the same as alone in a row."""
    cfg = ModelConfig.from_preset("tiny", num_layers=2, vocab_size=256, attention_impl="xla")
    mesh = build_mesh(MeshConfig(fsdp=2, sp=4), cfg, 256)
    graphdef, params = nnx.split(Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0)))
    step = make_token_step(graphdef, mesh, state_shardings(params))
    filler = BYTES.encode(passkey.FIXED_FILLER)
    a, b = (passkey.build_sample(BYTES, filler, length=128, depth=d, index=0, seed=seed) for d in (0.25, 0.75))
    rng = np.random.default_rng(seed)
    other = passkey.Sample(rng.integers(0, 256, 128).astype(np.int32), "x", (120, 125), 0, (0, 0), 0)
    scores = []
    for members in ([a, b], [other, b], [b]):
        rows, placements = passkey.pack_samples(members, 256)
        rows = {k: np.concatenate([v, v])[:2] if len(v) == 1 else v for k, v in rows.items()}
        loss, hit = (np.asarray(x) for x in step(params, {k: jax.device_put(v) for k, v in rows.items()}))
        at = placements[-1].offset
        scores.append((loss[0, at: at + 128], hit[0, at: at + 128]))
    (l_ab, h_ab), (l_ob, h_ob), (l_b, h_b) = scores
    np.testing.assert_allclose(l_ab, l_ob, rtol=1e-6, atol=1e-6)  # another neighbour: nothing changes
    np.testing.assert_allclose(l_ab, l_b, rtol=2e-5, atol=2e-5)  # alone at the row's start: the same
    assert (h_ab == h_ob).all() and (h_ab == h_b).all()
    assert l_ab[-1] == 0.0 and (l_ab[:-1] > 0).all()  # the sample's last token has no label in the row


def test_data_filler_reads_the_held_out_documents(tmp_path):
    from ulysses_jax.data.documents import DataConfig
    from ulysses_jax.evaluation.passkey_eval import filler_tokens

    corpus = tmp_path / "eval.txt"
    corpus.write_text("alpha beta gamma " * 40)
    cfg = DataConfig(paths=(str(corpus),), eval_paths=(str(corpus),), eval_fraction=0.0)
    stream = filler_tokens(BYTES, "data", cfg, 300)
    assert ByteTokenizer().decode(stream[:17]) == "alpha beta gamma " and len(stream) >= 300
    s = passkey.build_sample(BYTES, stream, length=400, depth=0.5, index=0, seed=0)
    assert "alpha" in ByteTokenizer().decode(s.tokens) and len(s.tokens) == 400


def test_data_filler_reads_sft_records_longer_than_the_lengths(tmp_path):
    """An SFT run's held-out records, each longer than the passkey lengths asked for but within the run's rows: read
    in rows of the run's length (they were refused as longer than --seq-len 20, a length nobody gave; a review)."""
    import json

    import test_cli_hf as hf_helpers

    from ulysses_jax.data.documents import DataConfig
    from ulysses_jax.data.tokenizers import make_tokenizer
    from ulysses_jax.evaluation.passkey_eval import filler_tokens

    folder = hf_helpers.make_folder(tmp_path / "folder")
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": "the sky is blue . " * 6, "completion": "blue"}) + "\n"
                            for _ in range(3)))
    cfg = DataConfig(paths=(str(data),), eval_paths=(str(data),), tokenizer=str(folder), format="sft",
                     eval_fraction=0.0)
    fmt = passkey.PromptFormat.plain(make_tokenizer(str(folder)))
    assert len(filler_tokens(fmt, "data", cfg, 20, row=64)) >= 20
    with pytest.raises(ValueError, match="longer than --seq-len 20"):  # as it read them before
        filler_tokens(fmt, "data", cfg, 20)
