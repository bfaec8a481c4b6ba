"""SFT rendering: hand-checked label masks (prompt/completion, chat templates with and without generation markers),
the tokenizer's BOS/EOS conventions, unicode through byte-level BPE, refusals, and the masked loss and gradients
equal on fsdp=2 x sp=4 and on one device."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from flax import nnx
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

import ulysses_jax as uj
from ulysses_jax.data.sft import IGNORE, SFTRenderer, read_jsonl

SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>"]
WORDS = ["the", "sky", "is", "blue", ".", "system", "user", "assistant", "be", "brief", "hi", "hello", "there",
         "bye", "now", "what", "colour", "it", "red", "green", "?"]

CHATML = ("{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
CHATML_MARKED = ("{%- for m in messages %}{%- if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
                 "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
                 "{%- else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
                 "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3 = ("{{- bos_token }}{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
          " + m['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}"
          "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


def word_folder(path, *, tokenizer_config, bos_post_processor=False, generation_config=None):
    """A model folder whose tokenizer.json maps whole words (and the special tokens) to ids: easy to read."""
    path.mkdir()
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    if bos_post_processor:  # Llama 3 style: the tokenizer itself prepends BOS
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def chatml_folder(tmp_path, template=CHATML, name="chatml"):
    return word_folder(tmp_path / name, tokenizer_config=dict(bos_token=None, eos_token="<|im_end|>",
                                                              chat_template=template))


def show(renderer, example):
    """Tokens as words, ``*`` after each position whose label (the next token) counts."""
    words = [renderer.tokenizer.id_to_token(int(t)) for t in example.tokens]
    return " ".join(w + "*" * bool(m) for w, m in zip(words, example.loss_mask))


def test_prompt_completion_hand_checked(tmp_path):
    folder = word_folder(tmp_path / "llama", tokenizer_config=dict(bos_token="<s>", eos_token="</s>"),
                         bos_post_processor=True)
    r = SFTRenderer(folder)
    ex = r.record({"prompt": "the sky is", "completion": " blue."})
    # "is" predicts "blue", "blue" predicts ".", "." predicts "</s>"; "</s>" has no next token
    assert show(r, ex) == "<s> the sky is* blue* .* </s>"
    assert ex.tokens.dtype == np.int32 and ex.loss_mask.dtype == bool
    ids = {w: r.tokenizer.token_to_id(w) for w in ("blue", ".", "</s>")}
    np.testing.assert_array_equal(ex.labels(), [IGNORE] * 3 + [ids["blue"], ids["."], ids["</s>"], IGNORE])


def test_messages_hand_checked(tmp_path):
    r = SFTRenderer(chatml_folder(tmp_path))
    messages = [dict(role="system", content="be brief"), dict(role="user", content="hi"),
                dict(role="assistant", content="hello there"), dict(role="user", content="bye"),
                dict(role="assistant", content="bye now")]
    ex = r.record({"messages": messages})
    assert show(r, ex) == (
        "<|im_start|> system be brief <|im_end|> <|im_start|> user hi <|im_end|> "
        "<|im_start|> assistant* hello* there* <|im_end|> <|im_start|> user bye <|im_end|> "
        "<|im_start|> assistant* bye* now* <|im_end|>")
    # conversational prompt-completion: the completion's messages are trained
    pc = r.record({"prompt": messages[:4], "completion": messages[4:]})
    assert show(r, pc).endswith("user bye <|im_end|> <|im_start|> assistant* bye* now* <|im_end|>")
    assert pc.loss_mask.sum() == 3


def test_llama3_template_writes_bos_once(tmp_path):
    folder = word_folder(tmp_path / "l3", tokenizer_config=dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                                                chat_template=LLAMA3), bos_post_processor=True)
    r = SFTRenderer(folder)
    ex = r.record({"messages": [dict(role="user", content="hi"), dict(role="assistant", content=" hello ")]})
    assert show(r, ex) == ("<|begin_of_text|> <|start_header_id|> user <|end_header_id|> hi <|eot_id|> "
                           "<|start_header_id|> assistant <|end_header_id|>* hello* <|eot_id|>")


def random_conversation(rng, words=WORDS[8:]):
    n = int(rng.integers(1, 4))
    out = [dict(role="system", content="be brief")] if rng.random() < 0.5 else []
    for _ in range(n):
        for role in ("user", "assistant"):
            out.append(dict(role=role, content=" ".join(rng.choice(words, int(rng.integers(1, 5))))))
    return out


def test_generation_markers_agree_with_prefix_rule(tmp_path, seed):
    plain, marked = SFTRenderer(chatml_folder(tmp_path)), SFTRenderer(chatml_folder(tmp_path, CHATML_MARKED, "m"))
    rng = np.random.default_rng(seed)
    for _ in range(10):
        conv = random_conversation(rng)
        a, b = plain.record({"messages": conv}), marked.record({"messages": conv})
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
        assert a.loss_mask.sum() == sum(len(m["content"].split()) + 1 for m in conv if m["role"] == "assistant")
        # a conversational prompt/completion record whose prompt holds assistant turns: the markers stripped from every
        # rendering compared (the prompt's kept them, and it was refused, advising the markers it had; a review)
        cut = 2 * int(rng.integers(1, len(conv) // 2 + 1)) - (0 if conv[0]["role"] == "system" else 1)
        record = {"prompt": conv[:cut], "completion": conv[cut:cut + 1]}
        a, b = plain.record(record), marked.record(record)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.loss_mask, b.loss_mask)


def test_byte_level_unicode_spans(tmp_path, seed):
    """Byte-level BPE splits characters across tokens; the trained tokens still decode to exactly the assistant text."""
    rng = np.random.default_rng(seed)
    alphabet = list("abcdefgh ijk éüß 日本 🙂.,!?")
    texts = ["".join(rng.choice(alphabet, int(rng.integers(1, 20)))) for _ in range(40)]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path / "bpe"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(eos_token="<|im_end|>", chat_template=CHATML)))
    r = SFTRenderer(folder)
    for i in range(0, 40, 4):
        conv = [dict(role="user", content=texts[i]), dict(role="assistant", content=texts[i + 1]),
                dict(role="user", content=texts[i + 2]), dict(role="assistant", content=texts[i + 3])]
        ex = r.record({"messages": conv})
        trained = ex.tokens[1:][ex.loss_mask[:-1]]  # the tokens that the counted labels name
        assert tok.decode(trained.tolist(), skip_special_tokens=False) == "".join(
            m["content"] + "<|im_end|>\n" for m in conv[1::2])
        pc = r.record({"prompt": texts[i], "completion": texts[i + 1]})
        assert tok.decode(pc.tokens[1:][pc.loss_mask[:-1]].tolist(), skip_special_tokens=False) == texts[i + 1] + (
            "<|im_end|>")


def test_tokenizer_conventions(tmp_path):
    llama = uj.tokenizer_conventions(word_folder(
        tmp_path / "llama", tokenizer_config=dict(bos_token="<s>", eos_token="</s>"), bos_post_processor=True))
    assert (llama.bos_token, llama.eos_token, llama.add_bos, llama.stop_ids) == ("<s>", "</s>", True, (2,))
    np.testing.assert_array_equal(llama.frame([10, 11]), [1, 10, 11, 2])
    off = uj.tokenizer_conventions(word_folder(  # add_bos_token in tokenizer_config.json overrides the post-processor
        tmp_path / "off", tokenizer_config=dict(bos_token="<s>", eos_token="</s>", add_bos_token=False),
        bos_post_processor=True))
    assert not off.add_bos
    mistral = uj.tokenizer_conventions(word_folder(
        tmp_path / "mistral", tokenizer_config=dict(bos_token={"content": "<s>"}, eos_token="</s>",
                                                    add_bos_token=True)))
    assert mistral.add_bos and mistral.bos_id == 1
    im_end, eot = SPECIAL.index("<|im_end|>"), SPECIAL.index("<|eot_id|>")
    qwen = uj.tokenizer_conventions(word_folder(
        tmp_path / "qwen", tokenizer_config=dict(bos_token=None, eos_token="<|im_end|>", chat_template=CHATML),
        generation_config=dict(eos_token_id=[im_end, eot])))
    assert (qwen.bos_id, qwen.add_bos, qwen.eos_id, qwen.stop_ids) == (None, False, im_end, (im_end, eot))
    assert qwen.chat_template == CHATML
    np.testing.assert_array_equal(qwen.frame([10]), [10, im_end])
    with pytest.raises(ValueError, match="eos_token '<nope>' is not in tokenizer.json"):
        uj.tokenizer_conventions(word_folder(tmp_path / "bad", tokenizer_config=dict(eos_token="<nope>")))
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        uj.tokenizer_conventions(tmp_path)


def test_bad_records_and_templates(tmp_path):
    r = SFTRenderer(chatml_folder(tmp_path))
    bad = {
        "needs string or message-list 'prompt' and 'completion'": {"text": "the sky"},
        "no assistant message": {"messages": [dict(role="user", content="hi")]},
        r"messages\[1\] must be an object": {"messages": [dict(role="user", content="hi"), dict(role="assistant")]},
        "must be a non-empty list": {"messages": []},
    }
    for match, record in bad.items():
        with pytest.raises(ValueError, match=match):
            r.record(record)
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "completion": "hello"}) + "\n\n" + "{not json\n")
    with pytest.raises(ValueError, match=r"sft\.jsonl:3: "):
        list(read_jsonl(data, r))
    # a template that shortens earlier assistant turns once later ones follow has no stable prefix
    shortening = CHATML.replace("m['content']", "(m['content'] if loop.last or m['role'] != 'assistant' else 'x')")
    r2 = SFTRenderer(chatml_folder(tmp_path, shortening, "short"))
    conv = [dict(role="user", content="hi"), dict(role="assistant", content="hello"),
            dict(role="user", content="bye"), dict(role="assistant", content="bye now")]
    with pytest.raises(ValueError, match=r"message 1 \(assistant\).*generation"):
        r2.record({"messages": conv})
    r3 = SFTRenderer(chatml_folder(tmp_path, "{{ raise_exception('only user turns') }}", "raises"))
    with pytest.raises(ValueError, match="only user turns"):
        r3.record({"messages": conv})
    r4 = SFTRenderer(word_folder(tmp_path / "none", tokenizer_config=dict(eos_token="</s>")))
    with pytest.raises(ValueError, match="has no chat template"):
        r4.record({"messages": conv})


def test_masked_loss_and_gradients_equal_across_meshes(tmp_path, seed):
    """Packed SFT documents with masked labels: loss and gradients on fsdp=2 x sp=4 equal one device's, and the
    loss is the mean over exactly the masked-in positions."""
    r = SFTRenderer(chatml_folder(tmp_path))
    rng = np.random.default_rng(seed)
    rows, S = 2, 64
    batch = {k: np.zeros((rows, S), np.int32) for k in ("tokens", "segment_ids")}
    batch["labels"] = np.full((rows, S), IGNORE, np.int32)
    for row in range(rows):
        at, seg = 0, 1
        while True:
            rec = {"messages": random_conversation(rng)} if rng.random() < 0.7 else {
                "prompt": " ".join(rng.choice(WORDS[:5], 3)), "completion": " ".join(rng.choice(WORDS[8:], 2))}
            ex = r.record(rec)
            if at + len(ex.tokens) > S:
                break
            sl = slice(at, at + len(ex.tokens))
            batch["tokens"][row, sl], batch["labels"][row, sl] = ex.tokens, ex.labels()
            batch["segment_ids"][row, sl] = seg
            at, seg = at + len(ex.tokens), seg + 1
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    cfg = uj.ModelConfig(vocab_size=32, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=96,
                         compute_dtype="float32", attention_impl="xla")

    @nnx.jit
    def loss_and_grads(model, batch):
        return nnx.value_and_grad(lambda m: uj.next_token_loss(m, batch).loss)(model)

    results = []
    for mesh in (uj.make_mesh(fsdp=2, sp=4), uj.make_mesh(fsdp=1, sp=1, devices=jax.devices()[:1])):
        model = uj.Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(seed))
        loss, grads = loss_and_grads(model, batch)
        results.append((float(loss), {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(grads)}))
        if mesh.size == 1:
            logits = np.asarray(model(batch["tokens"], None, batch["segment_ids"]), np.float64)
    (loss8, g8), (loss1, g1) = results
    np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
    for k in g1:
        np.testing.assert_allclose(g8[k], g1[k], rtol=1e-4, atol=1e-6, err_msg=str(k))
    labels = np.asarray(batch["labels"])
    b, s = np.nonzero(labels >= 0)
    assert 0 < len(b) < int((np.asarray(batch["segment_ids"]) > 0).sum()) // 2  # most positions are masked out
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    np.testing.assert_allclose(loss1, -logp[b, s, labels[b, s]].mean(), rtol=1e-5)


def test_a_generation_prompt_ending_in_a_space_trains_the_answers_first_token(tmp_path):
    """`ASSISTANT: ` + `hello`: byte-level BPE makes ` hello` one token, whose first character (the space) is the
    template's; it counts, as transformers' assistant masks count a token with any character in the answer (the
    first-character rule left every answer's first token untrained; noticed by a review)."""
    texts = ["USER: hello there\nASSISTANT: hello there\n"] * 20
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path / "bpe"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    template = ("{%- for m in messages %}{{ m['role'] | upper + ': ' + m['content'] + '\\n' }}{%- endfor %}"
                "{%- if add_generation_prompt %}{{ 'ASSISTANT: ' }}{%- endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(eos_token="</s>", chat_template=template)))
    r = SFTRenderer(folder)
    ex = r.record({"messages": [dict(role="user", content="hello"), dict(role="assistant", content="hello there")]})
    assert tok.decode(ex.tokens[1:][ex.loss_mask[:-1]].tolist()) == " hello there\n"
