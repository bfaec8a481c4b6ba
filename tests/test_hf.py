"""Hugging Face import/export against transformers itself: tiny random models of each architecture, logits and
packed-document loss on fsdp=2 x sp=4 and on one device, export -> transformers -> same logits, import ->
export -> import bit-identical, bf16 files, sharded folders, and every refusal (one line naming the culprit)."""

import dataclasses
import io
import json
import logging
import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ulysses_jax as uj
from ulysses_jax.interop import hf

try:
    import torch
    import transformers
except ImportError:  # CI must run the parity: there a missing install fails instead of skipping
    if os.environ.get("CI"):
        raise
    pytest.skip("needs torch and transformers: pip install -e '.[test]'", allow_module_level=True)

B, S, VOCAB = 2, 32, 96
TOL = 1e-4  # float32 logits, absolute
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
LLAMA3 = dict(rope_theta=500_000.0, rms_norm_eps=1e-5, rope_scaling=dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16))
CASES = {  # name -> (config class, settings); llama3 scaling with original length 16 < S hits all three bands
    "llama3-untied": ("LlamaConfig", dict(LLAMA3, tie_word_embeddings=False)),
    "llama3-tied": ("LlamaConfig", dict(LLAMA3, tie_word_embeddings=True)),
    "qwen2-tied": ("Qwen2Config", dict(rope_theta=1e6, tie_word_embeddings=True)),
    "qwen3-untied": ("Qwen3Config", dict(rope_theta=1e6, head_dim=32, tie_word_embeddings=False)),  # N*H != D
    # YaRN x4 of an original 16 tokens (< S): the ramp between beta_fast and beta_slow, and the attention factor
    "qwen3-yarn": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False, rope_parameters=dict(
        rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=16))),
    "mistral-untied": ("MistralConfig", dict(rope_theta=1e6, sliding_window=None, tie_word_embeddings=False)),
    # sliding windows (5 tokens < the documents): Mistral on every layer, Qwen2 from layer max_window_layers on
    "mistral-window": ("MistralConfig", dict(rope_theta=1e6, sliding_window=5, tie_word_embeddings=False)),
    "qwen2-window": ("Qwen2Config", dict(rope_theta=1e6, use_sliding_window=True, sliding_window=5,
                                         max_window_layers=1, tie_word_embeddings=True)),
    # Gemma 3 text: local, local, global; local RoPE base 1e4, global 1e6 scaled linearly x8; 1/sqrt(24) scale
    "gemma3": ("Gemma3TextConfig", dict(
        num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=5,
        query_pre_attn_scalar=24, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}})),
}
XLA32 = dict(compute_dtype="float32", attention_impl="xla")


def hf_model(case: str, seed: int):
    """A transformers model of ``case`` with every parameter random (norm scales around 1, biases nonzero)."""
    cls_name, settings = CASES[case]
    config = getattr(transformers, cls_name)(**{**SMALL, **settings})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
    return model


def save(model, path, **kw):
    model.save_pretrained(path, **kw)
    return path


def one_device():
    return uj.make_mesh(fsdp=1, sp=1, devices=jax.devices()[:1])


def doc_lengths(rng, total=S, docs=3):
    cuts = np.sort(rng.choice(np.arange(2, total - 1), docs - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [total]]))


def hf_logits(model, tokens, lengths=None):
    """transformers' float32 logits; packed rows: each document run alone."""
    with torch.no_grad():
        if lengths is None:
            return model(torch.tensor(tokens)).logits.numpy()
        rows = [torch.cat([model(t[None]).logits[0] for t in torch.split(torch.tensor(row), lengths.tolist())])
                for row in tokens]
        return torch.stack(rows).numpy()


@nnx.jit
def forward(model, batch):
    """Logits and next-token loss of a batch of packed rows (positions restart with each segment)."""
    h = model.hidden_states(batch["tokens"], None, batch["segment_ids"])
    return model.logits(h), uj.next_token_loss(model, batch, hidden=h)


def params_of(model):
    return {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def report(ours, ref):
    err = np.abs(np.asarray(ours) - ref)
    return f"max abs {err.max():.2e}, max rel {(err / np.maximum(np.abs(ref), 1e-6)).max():.2e}"


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_transformers(case, seed, tmp_path):
    ref_model = hf_model(case, seed)
    src = save(ref_model, tmp_path / "src")
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (B, S))
    lengths = doc_lengths(rng)  # row 0: one document; row 1: documents of these lengths, packed
    segment_ids = np.stack([np.ones(S, int), np.repeat(np.arange(1, len(lengths) + 1), lengths)])
    ref = np.concatenate([hf_logits(ref_model, tokens[:1]), hf_logits(ref_model, tokens[1:], lengths)])
    with torch.no_grad():  # transformers 5 separates packed documents by position_ids itself (no mask, no cache)
        positions = torch.tensor(np.concatenate([np.arange(n) for n in lengths]))[None]
        hf_packed = ref_model(torch.tensor(tokens[1:]), position_ids=positions, use_cache=False).logits.numpy()
    np.testing.assert_allclose(hf_packed, ref[1:], atol=TOL, rtol=0)

    # loss: next-token cross-entropy within each document, token-weighted over the batch
    logp = torch.log_softmax(torch.tensor(ref, dtype=torch.float64), -1).numpy()
    labels = np.asarray(uj.shift_labels(jnp.asarray(tokens), jnp.asarray(segment_ids)))
    b, s = np.nonzero(labels >= 0)
    ref_loss = -logp[b, s, labels[b, s]].mean()

    batch = dict(tokens=jnp.asarray(tokens), labels=jnp.asarray(labels), segment_ids=jnp.asarray(segment_ids))
    for mesh in (uj.make_mesh(fsdp=2, sp=4), one_device()):
        model = hf.from_hf(src, mesh=mesh, **XLA32)
        fresh = nnx.eval_shape(lambda m=model, mesh=mesh: uj.Transformer(m.config, mesh=mesh, rngs=nnx.Rngs(0)))
        at_rest = {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(uj.param_shardings(fresh, mesh))}
        for k, v in params_of(model).items():  # born in the at-rest layout of a fresh model
            assert v.sharding == at_rest[k], k
        ours, out = forward(model, batch)
        assert np.abs(np.asarray(ours) - ref).max() <= TOL, f"{case} on {dict(mesh.shape)}: {report(ours, ref)}"
        assert int(out.count) == len(b) == 2 * S - 1 - len(lengths)
        np.testing.assert_allclose(float(out.loss), ref_loss, rtol=1e-5)

    # export -> transformers loads it, nothing missing or unexpected, same class, same logits
    out_dir = tmp_path / "export"
    hf.to_hf(model, out_dir, tokenizer_from=src)
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    transformers.utils.logging.get_logger("transformers").addHandler(handler)
    try:
        loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out_dir, output_loading_info=True)
    finally:
        transformers.utils.logging.get_logger("transformers").removeHandler(handler)
    assert {k: v for k, v in info.items() if len(v)} == {}, info
    assert not any(w in log.getvalue().lower() for w in ("missing", "unexpected", "newly initialized", "not used"))
    assert type(loaded) is type(ref_model)
    np.testing.assert_array_equal(hf_logits(loaded.eval(), tokens), hf_logits(ref_model, tokens))
    # the exported tensors are the source's, bit for bit, and import -> export -> import is the identity
    from safetensors.numpy import load_file

    # same names, shapes, dtypes and bits (chex names the first leaf that differs)
    chex.assert_trees_all_equal(load_file(out_dir / "model.safetensors"), load_file(src / "model.safetensors"),
                                strict=True)
    again = hf.from_hf(out_dir, mesh=mesh, **XLA32)
    first, second = params_of(model), params_of(again)
    chex.assert_trees_all_equal(second, first, strict=True)
    for k in first:
        assert first[k].sharding.is_equivalent_to(second[k].sharding, first[k].ndim), k


def test_bf16_sharded_folder_round_trip(seed, tmp_path):
    """bf16 files split in shards: import as float32 (exact upcast) and as bf16, export bf16 bit-identical."""
    ref_model = hf_model("qwen2-tied", seed).to(torch.bfloat16)
    src = save(ref_model, tmp_path / "src", max_shard_size="40KB")
    assert (src / "model.safetensors.index.json").is_file()
    mesh = uj.make_mesh(fsdp=2, sp=4)
    model32 = hf.from_hf(src, mesh=mesh, **XLA32)
    model16 = hf.from_hf(src, mesh=mesh, param_dtype="bfloat16", **XLA32)
    assert model32.config.param_dtype == "float32" and params_of(model16)["embed_VD"].dtype == jnp.bfloat16
    embed = ref_model.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(params_of(model32)["embed_VD"]), embed)
    for dtype, model in (("bfloat16", model32), (None, model16)):
        out = tmp_path / f"export-{dtype}"
        hf.to_hf(model, out, dtype=dtype, max_shard_bytes=30_000)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        files = set(index["weight_map"].values())
        assert len(files) > 1 and all(os.path.getsize(out / f) < 30_000 + 4096 for f in files)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
        theirs, ours = ref_model.state_dict(), loaded.state_dict()
        for name in theirs:
            assert torch.equal(ours[name], theirs[name]), name
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_table_covers_every_parameter():
    """Each parameter of each model variant has exactly one row of the table, and the reshapes invert."""
    mesh = one_device()
    for tie in (False, True):
        for extra in ({}, {"qkv_bias": True}, {"qk_norm": True}, {"qk_norm": True, "post_norms": True}):
            cfg = uj.ModelConfig(tie_embeddings=tie, **extra)
            model = nnx.eval_shape(lambda cfg=cfg: uj.Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0)))
            shapes = {k: v.shape for k, v in params_of(model).items()}
            rows = {e.param: e for e in hf.entries(cfg)}
            assert rows.keys() == shapes.keys()
            sizes = hf.letter_sizes(cfg)
            for name, entry in rows.items():
                x = np.arange(np.prod(shapes[name][1 if entry.stacked else 0:])).reshape(
                    shapes[name][1 if entry.stacked else 0:])
                assert entry.to_hf(x, sizes).shape == entry.hf_shape(sizes)
                np.testing.assert_array_equal(entry.to_ours(entry.to_hf(x, sizes), sizes), x)


def test_config_layouts_and_refusals(tmp_path):
    """transformers 4 (rope_theta + rope_scaling) and 5 (rope_parameters) layouts; each refusal names its field."""
    base = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128, hidden_size=64,
                intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=4096)
    scaling = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)

    def config(**changes):
        folder = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({k: v for k, v in {**base, **changes}.items() if v != "-"}))
        return folder

    v4 = uj.ModelConfig.from_hf(config(rope_theta=500000.0, rope_scaling=scaling))
    v5 = uj.ModelConfig.from_hf(config(rope_parameters=dict(scaling, rope_theta=500000.0)))
    assert v4 == dataclasses.replace(v5, name=v4.name) and v4.rope_scaling == uj.RopeScaling(factor=32.0)
    assert v4.head_dim == 16 and v4.tie_embeddings
    assert uj.ModelConfig.from_hf(config(rope_scaling=None), remat="full").remat == "full"
    qwen3 = uj.ModelConfig.from_hf(config(architectures=["Qwen3ForCausalLM"], head_dim=32))
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 32 and qwen3.rope_theta == 10_000.0
    qwen2 = uj.ModelConfig.from_hf(config(architectures=["Qwen2ForCausalLM"], sliding_window=131072,
                                          use_sliding_window=False))
    assert qwen2.qkv_bias and not qwen2.qk_norm
    bad = {
        "architectures": dict(architectures=["GPT2LMHeadModel"]),
        "a layer type ulysses_jax does not know": dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                                                       sliding_window=8, layer_types=["chunked_attention"] * 2),
        "sliding_window = 0 must be a positive number": dict(architectures=["MistralForCausalLM"], sliding_window=0),
        "Gemma 3 vision-language model": dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3",
                                              text_config={}, vision_config={}),
        "final_logit_softcapping": dict(architectures=["Gemma3ForCausalLM"], final_logit_softcapping=30.0),
        "rope_scaling.rope_type": dict(rope_scaling=dict(rope_type="longrope", factor=4.0)),
        "rope_scaling.mscale": dict(rope_scaling=dict(rope_type="yarn", factor=4.0, mscale=0.7, mscale_all_dim=0.7)),
        "rope_parameters.rope_type": dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)),
        "attention_bias": dict(attention_bias=True),
        "hidden_act": dict(hidden_act="gelu"),
        "layer_types": dict(layer_types=["sliding_attention", "full_attention"]),
        "intermediate_size": dict(intermediate_size="-"),
    }
    for field, changes in bad.items():
        with pytest.raises(ValueError, match=field.replace(".", r"\.")) as err:
            uj.ModelConfig.from_hf(config(**changes))
        assert "\n" not in str(err.value)
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):  # named before Llama's refusal, Qwen's window switch
        with pytest.raises(ValueError, match="layer_types has 'chunked_attention', a layer type ulysses_jax does not"):
            uj.ModelConfig.from_hf(config(architectures=[arch], layer_types=["chunked_attention", "full_attention"]))
    # Mistral without the key: transformers takes a window of 4096 on every layer; Qwen2 windows from max_window_layers
    mistral = uj.ModelConfig.from_hf(config(architectures=["MistralForCausalLM"], model_type="mistral"))
    assert (mistral.sliding_window, mistral.layer_pattern) == (4096, ())
    qwen2 = uj.ModelConfig.from_hf(config(architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                                          sliding_window=64, max_window_layers=1))
    assert (qwen2.sliding_window, qwen2.layer_pattern, qwen2.window_kinds) == (64, ("global", "local"), (None, 64))
    gemma = uj.ModelConfig.from_hf(config(architectures=["Gemma3ForCausalLM"], num_hidden_layers=8, head_dim=16,
                                          sliding_window=512, rope_scaling=dict(rope_type="linear", factor=8.0)))
    assert gemma.layer_pattern == ("local",) * 5 + ("global",) and gemma.rope_local_theta == 10_000.0
    assert gemma.rope_scaling == uj.RopeScaling(factor=8.0, rope_type="linear") and gemma.post_norms
    with pytest.raises(ValueError, match="config.json does not exist"):
        uj.ModelConfig.from_hf(tmp_path / "nowhere")


def test_keys_left_out_read_as_transformers_reads_them(tmp_path):
    """A config.json without a key transformers' class gives a default (found by a review: the generic defaults gave
    silently wrong logits): Mixtral's theta and norm epsilon, gpt-oss's biases, theta, epsilon and head_dim, Gemma 3's
    query scale and head_dim, Qwen3's head_dim, YaRN's original length (the file's max_position_embeddings, not it
    over the factor); and Qwen3-MoE's window, which covers every layer (its class reads no layer_types). Each value
    is the one transformers' own config class reads from the same file."""
    transformers = pytest.importorskip("transformers")
    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64)
    experts = dict(num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=2)
    cases = {  # Gemma 3's and Qwen3-MoE's KV heads by default (4), the others' defaults (8, 32) above the 4 heads
        "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", **experts),
        "gpt_oss": dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", **experts, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"]),
        "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", sliding_window=8),
        "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_key_value_heads=2),
        "yarn": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_key_value_heads=2, rope_theta=1e6,
                     rope_scaling=dict(rope_type="yarn", factor=4.0)),
        "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, num_hidden_layers=3,
                          use_sliding_window=True, sliding_window=5, max_window_layers=2),
    }
    for name, keys in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**shape, **keys}))
        ours, theirs = uj.ModelConfig.from_hf(folder), transformers.AutoConfig.from_pretrained(folder)
        rope = theirs.rope_parameters
        rope = rope.get("full_attention", rope)
        assert ours.rope_theta == rope["rope_theta"] and ours.rms_eps == theirs.rms_norm_eps, name
        head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads  # none: divide
        assert ours.head_dim == head_dim and ours.num_kv_heads == theirs.num_key_value_heads, name
        if name == "gpt_oss":
            assert ours.qkv_bias and theirs.attention_bias
        if name == "gemma3":
            assert ours.query_pre_attn_scalar == theirs.query_pre_attn_scalar == 256
        if name == "yarn":
            assert ours.rope_scaling.original_max_position == rope["original_max_position_embeddings"] == 64
        if name == "qwen3_moe":
            assert (ours.sliding_window, ours.layer_pattern, ours.window_kinds) == (5, (), (5,))
            assert theirs.sliding_window == 5
    local_global = dataclasses.replace(ours, layer_pattern=("global", "local", "local"))
    with pytest.raises(ValueError, match="mixes local and global layers, which Qwen3MoeForCausalLM cannot hold"):
        hf.to_hf(uj.Transformer(local_global, mesh=uj.make_mesh(fsdp=1, sp=1, devices=jax.devices()[:1]),
                                rngs=nnx.Rngs(0)), tmp_path / "out")


@pytest.fixture
def llama_folder(tmp_path, seed):
    return save(hf_model("llama3-untied", seed), tmp_path / "src", max_shard_size="60KB")


def rewrite(folder, change):
    """Apply ``change(dict of arrays) -> dict`` to the shard holding layer 1's q_proj."""
    from safetensors.numpy import load_file, save_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    file = folder / index["weight_map"]["model.layers.1.self_attn.q_proj.weight"]
    save_file(change(load_file(file)), file, metadata={"format": "pt"})


def test_bad_folders_are_named(llama_folder, tmp_path):
    mesh = uj.make_mesh(fsdp=2, sp=4)
    q = "model.layers.1.self_attn.q_proj.weight"
    index = json.loads((llama_folder / "model.safetensors.index.json").read_text())

    def fails(match, folder=llama_folder, **kw):
        with pytest.raises(ValueError, match=match) as err:
            hf.from_hf(folder, mesh=mesh, **kw)
        assert "\n" not in str(err.value)

    fails("param_dtype 'int8'", param_dtype="int8")
    fails("num_layers come from", num_layers=3)
    broken = shutil.copytree(llama_folder, tmp_path / "missing-shard")
    (broken / index["weight_map"][q]).unlink()
    fails(f"shard {index['weight_map'][q]}, which is missing", broken)

    cases = {
        f"tensor {q} is missing": lambda t: {k: v for k, v in t.items() if k != q},
        f"tensor {q} in .* has shape": lambda t: {**t, q: t[q][:, :8]},
        f"tensor {q} in .* has dtype I32": lambda t: {**t, q: t[q].astype(np.int32)},
        "tensor model.layers.1.extra.weight in .* is unexpected": lambda t: {**t, "model.layers.1.extra.weight": t[q]},
    }
    for match, change in cases.items():
        folder = shutil.copytree(llama_folder, tmp_path / f"case{len(list(tmp_path.iterdir()))}")
        if "missing" in match:  # keep the index consistent: the tensor is gone from index and file alike
            idx = json.loads((folder / "model.safetensors.index.json").read_text())
            rewrite(folder, change)
            del idx["weight_map"][q]
            (folder / "model.safetensors.index.json").write_text(json.dumps(idx))
        else:
            rewrite(folder, change)
        fails(match, folder)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((llama_folder / "config.json").read_text())
    fails("neither model.safetensors nor model.safetensors.index.json", tmp_path / "empty")

    model = hf.from_hf(llama_folder, mesh=mesh, **XLA32)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not an empty folder"):
        hf.to_hf(model, tmp_path / "full")
    assert os.listdir(tmp_path / "full") == ["notes.txt"]
    with pytest.raises(ValueError, match="export dtype 'int8'"):
        hf.to_hf(model, tmp_path / "new", dtype="int8")


def test_export_copies_tokenizer_and_ids(llama_folder, tmp_path):
    """Tokenizer files and generation_config.json come from the source; token ids reach config.json."""
    (llama_folder / "tokenizer.json").write_text('{"version": "1.0"}')
    (llama_folder / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    model = hf.from_hf(llama_folder, mesh=one_device(), **XLA32)
    hf.to_hf(model, tmp_path / "out", tokenizer_from=llama_folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (llama_folder / name).read_bytes()
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"]) == (1, 2)
    assert written["architectures"] == ["LlamaForCausalLM"] and written["rope_scaling"]["rope_type"] == "llama3"


WORKER = r"""
import json, pathlib, sys
import jax, numpy as np
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid, src, out = sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3]), pathlib.Path(sys.argv[4])
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid)
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
import ulysses_jax as uj
from ulysses_jax.interop import hf
read = []
plain_read = hf.SafetensorsFolder.read
hf.SafetensorsFolder.read = lambda self, name, index: read.append(plain_read(self, name, index).size) or plain_read(
    self, name, index)
mesh = uj.make_mesh(fsdp=2, sp=4)
model = hf.from_hf(src, mesh=mesh, compute_dtype="float32", attention_impl="xla")
tokens = np.load(out / "tokens.npy")
tokens = jax.make_array_from_callback(tokens.shape, NamedSharding(mesh, P()), lambda i: tokens[i])
logits = multihost_utils.process_allgather(jax.jit(lambda m, t: m(t))(model, tokens), tiled=True)
if pid == 0:
    np.save(out / "logits.npy", np.asarray(logits))
(out / f"read{pid}.json").write_text(json.dumps(sum(read)))
hf.to_hf(model, out / "export", tokenizer_from=src)
"""


@pytest.mark.skipif(os.uname().sysname != "Linux", reason="gloo CPU collectives are tested on Linux only")
def test_two_processes_read_half_each_and_export(seed, tmp_path):
    """Two processes x 4 fake devices: each reads only its half of every tensor; export gathers, process 0 writes."""
    import socket
    import subprocess
    import sys

    ref_model = hf_model("llama3-untied", seed)
    src = save(ref_model, tmp_path / "src")
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (B, S))
    np.save(tmp_path / "tokens.npy", tokens)
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(port), str(i), str(src), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    ref = hf_logits(ref_model, tokens)
    ours = np.load(tmp_path / "logits.npy")
    assert np.abs(ours - ref).max() <= TOL, report(ours, ref)
    total = sum(p.numel() for p in ref_model.parameters())  # every llama tensor is split along the model width
    assert [json.loads((tmp_path / f"read{i}.json").read_text()) for i in range(2)] == [total // 2] * 2
    from safetensors.numpy import load_file

    theirs, exported = load_file(src / "model.safetensors"), load_file(tmp_path / "export" / "model.safetensors")
    assert theirs.keys() == exported.keys()
    for name in theirs:
        np.testing.assert_array_equal(exported[name], theirs[name], err_msg=name)


def test_any_block_reads_as_the_whole_tensor_cut(llama_folder, seed):
    """Reading a block (cuts on merged HF dimensions too, e.g. heads) equals cutting the whole tensor."""
    cfg = uj.ModelConfig.from_hf(llama_folder)
    folder = hf.SafetensorsFolder(llama_folder)
    rng = np.random.default_rng(seed)
    sizes = hf.letter_sizes(cfg)
    for entry in hf.entries(cfg):
        whole = hf._read_block(folder, entry, cfg, tuple(slice(0, n) for n in
                                                          ((cfg.num_layers,) if entry.stacked else ()) +
                                                          tuple(sizes[c] for c in entry.dims)), np.float32)
        cut = tuple(slice(a, b) for a, b in (np.sort(rng.choice(n + 1, 2, replace=False)) for n in whole.shape))
        np.testing.assert_array_equal(hf._read_block(folder, entry, cfg, cut, np.float32), whole[cut], entry.param)
    folder.release()
