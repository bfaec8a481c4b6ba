"""gpt-oss against transformers: a tiny random GptOssForCausalLM folder (attention sinks, a sliding and a full layer,
biases on q/k/v/o, YaRN RoPE, 4 experts top-2 with the clamped SwiGLU) gives the same logits within 1e-4 (float32) on
one device and on fsdp 2 x sp 4, exports to a folder transformers reloads, and the sinks and the window matter; the
Hub's MXFP4 expert weights dequantise as transformers does and import as the float folder; presets and refusals."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ulysses_jax as uj
from ulysses_jax.interop import hf, mxfp4
from ulysses_jax.model import flops

try:
    import test_cli_hf as hf_helpers
    import torch
    import transformers
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
except ImportError:  # CI must run the parity: there a missing install fails instead of skipping
    if os.environ.get("CI"):
        raise
    pytest.skip("needs torch and transformers: pip install -e '.[test]'", allow_module_level=True)

VOCAB, TOL = 96, 1e-4
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_local_experts=4,
              num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
              rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16},
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
XLA32 = dict(compute_dtype="float32", attention_impl="xla")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A transformers gpt-oss model, every parameter random (norm scales around 1, expert weights large enough for
    the SwiGLU's clamp at 7 to bite), saved in float32."""
    path = tmp_path_factory.mktemp("gpt-oss") / "tiny"
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG)).eval()
    hf_helpers.random_weights(model, 0, 0.2, scale_of=lambda name: 1.5 if "experts" in name else None)
    model.save_pretrained(path)
    return model, path


def logits_of(model, tokens):
    return np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))


def test_parity_export_and_what_matters(folder, tmp_path):
    ref_model, src = folder
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 32))
    with torch.no_grad():
        ref = ref_model(torch.tensor(tokens)).logits.numpy()
    for mesh in (uj.make_mesh(fsdp=2, sp=4), uj.make_mesh(fsdp=1, sp=1, devices=jax.devices()[:1])):
        model = hf.from_hf(src, mesh=mesh, **XLA32)
        cfg = model.config
        assert (cfg.expert_style, cfg.attn_sinks, cfg.o_bias, cfg.layer_pattern, cfg.sliding_window) == (
            "gpt_oss", True, True, ("local", "global"), 4)
        assert cfg.rope_scaling.rope_type == "yarn" and not cfg.rope_scaling.truncate
        err = np.abs(logits_of(model, tokens) - ref).max()
        assert err <= TOL, f"on {dict(mesh.shape)}: max abs {err:.2e}"

    hf.to_hf(model, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["GptOssForCausalLM"]
    with torch.no_grad():
        again = hf_helpers.load_quietly(tmp_path / "out")(torch.tensor(tokens)).logits.numpy()
    assert np.abs(again - ref).max() <= TOL

    # the sinks and the window matter: without them (sinks at -30, a window past the row) the logits move away
    params = nnx.state(model, nnx.Param)
    sinks = params["blocks"]["attn"]["sinks_N"]
    sinks.set_value(jnp.full_like(sinks.get_value(), -30.0))
    nnx.update(model, params)
    assert np.abs(logits_of(model, tokens) - ref).max() > 1e-2
    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "model.safetensors").symlink_to(src / "model.safetensors")
    raw = json.loads((src / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**raw, "sliding_window": 64}))
    assert np.abs(logits_of(hf.from_hf(wide, mesh=model.mesh, **XLA32), tokens) - ref).max() > 1e-2


def test_mxfp4_dequantizes_as_transformers_and_imports_as_floats(folder, tmp_path):
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (3, 8, 2, 16), dtype=np.uint8)
    scales = rng.integers(120, 134, (3, 8, 2), dtype=np.uint8)
    theirs = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32).numpy()
    np.testing.assert_array_equal(mxfp4.dequantize(blocks, scales), theirs)  # exact: powers of two times E2M1

    # the tiny folder with its expert matrices replaced by random MXFP4 tensors, and the same weights in floats
    _, src = folder
    tensors = load_file(str(src / "model.safetensors"))
    quant, floats = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        e, n_in, n_out = tensors[name].shape
        b = rng.integers(0, 256, (e, n_out, n_in // 32, 16), dtype=np.uint8)
        s = rng.integers(122, 128, (e, n_out, n_in // 32), dtype=np.uint8)
        del quant[name]
        quant[name + "_blocks"], quant[name + "_scales"] = b, s
        floats[name] = convert_moe_packed_tensors(torch.tensor(b), torch.tensor(s), dtype=torch.float32).numpy()
    raw = json.loads((src / "config.json").read_text())
    for path, weights, extra in ((tmp_path / "q", quant, {"quantization_config": {"quant_method": "mxfp4"}}),
                                 (tmp_path / "f", floats, {})):
        path.mkdir()
        save_file(weights, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps({**raw, **extra}))
    mesh = uj.make_mesh(fsdp=2, sp=4)
    tokens = np.random.default_rng(2).integers(0, VOCAB, (2, 32))
    a = logits_of(hf.from_hf(tmp_path / "q", mesh=mesh, **XLA32), tokens)
    np.testing.assert_array_equal(a, logits_of(hf.from_hf(tmp_path / "f", mesh=mesh, **XLA32), tokens))

    raw["quantization_config"] = {"quant_method": "bitsandbytes"}
    (tmp_path / "q" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"quantization_config.quant_method = 'bitsandbytes' is not supported"):
        uj.ModelConfig.from_hf(tmp_path / "q")


def test_presets_have_the_published_parameter_counts():
    """gpt-oss-20b 20.91B parameters, 3.61B active; gpt-oss-120b 116.83B, 5.13B active (OpenAI's model card, whose
    active counts leave out the embedding table)."""
    for name, total, active in (("gpt-oss-20b", 20.91e9, 3.61e9), ("gpt-oss-120b", 116.83e9, 5.13e9)):
        cfg = uj.ModelConfig.from_preset(name)
        assert abs(flops.param_count(cfg) - total) < 0.01e9, name
        assert abs(flops.active_param_count(cfg) - cfg.vocab_size * cfg.hidden - active) < 0.01e9, name


def test_unknown_layer_type_is_refused(folder, tmp_path):
    _, src = folder
    raw = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "layer_types": ["chunked_attention", "full_attention"]}))
    with pytest.raises(ValueError, match=r"layer_types has .chunked_attention., a layer type ulysses_jax does not"):
        uj.ModelConfig.from_hf(tmp_path)
