"""ModelConfig presets against the published models, validation errors, and the FLOP count."""

import dataclasses
import math

import pytest

from ulysses_jax import ModelConfig, RopeScaling, flops_per_device, flops_per_token, mfu, param_count, peak_flops
from ulysses_jax.model.config import PRESETS
from ulysses_jax.model.flops import matmul_params, training_flops

# Parameter counts of the published checkpoints (distinct tensors; a tied head counted once).
PUBLISHED = {
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-0.6b": 596_049_920,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "mistral-7b": 7_248_023_552,
    "gemma3-1b": 999_885_952,
    # transformers' own count of its default configs (Qwen3_5TextConfig(), Qwen3_5MoeTextConfig(), Qwen3NextConfig(),
    # built on the meta device): the text models; Qwen3.5-9B's published 9B counts its vision tower too
    "qwen3.5-9b": 8_953_803_264,
    "qwen3.5-35b-a3b": 34_660_610_688,
    "qwen3-next-80b-a3b": 79_674_391_296,
    # transformers' count of Qwen3_5TextConfig with the Hub's Qwen/Qwen3.5-0.8B text_config (meta device)
    "qwen3.5-0.8b": 752_393_024,
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_have_the_published_parameter_count(name):
    cfg = ModelConfig.from_preset(name)
    assert cfg.name == name and param_count(cfg) == PUBLISHED[name]
    assert cfg.param_dtype == "float32" and cfg.compute_dtype == "bfloat16" and cfg.attention_impl == "auto"


def test_preset_features():
    # gemma3-4b: the text model of a vision-language one; the mixtures of experts: tests/test_moe.py
    assert set(PRESETS) == {"tiny", "gemma3-4b", "qwen3-30b-a3b", "mixtral-8x7b", "tiny-moe", "gpt-oss-20b",
                            "gpt-oss-120b", "tiny-hybrid", *PUBLISHED}
    gemma = {"gemma3-1b", "gemma3-4b"}
    assert {n for n, c in PRESETS.items() if c.post_norms and c.sliding_window} == gemma
    hybrids = {"qwen3.5-9b", "qwen3.5-0.8b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b", "tiny-hybrid"}
    assert {n for n, c in PRESETS.items() if c.qk_norm} == {"qwen3-0.6b", "qwen3-4b", "qwen3-8b", "qwen3-30b-a3b",
                                                            "tiny-moe", *gemma, *hybrids}
    assert {n for n, c in PRESETS.items() if c.linear_layers} == hybrids
    for name in hybrids:  # three delta-net layers to one gated, partially rotated full-attention layer
        c = PRESETS[name]
        assert c.linear_layers == tuple(i for i in range(c.num_layers) if i % 4 != 3)
        assert c.rotary_dim == c.head_dim // 4 and c.attn_output_gate
        assert c.attn_output_gate and c.norm_plus_one and (c.shared_expert_dim == 512) == bool(c.num_experts)
    assert {n for n, c in PRESETS.items() if c.qkv_bias} == {"qwen2.5-0.5b", "qwen2.5-7b", "gpt-oss-20b",
                                                             "gpt-oss-120b"}
    assert {n for n, c in PRESETS.items() if c.tie_embeddings} == {
        "llama3.2-1b", "llama3.2-3b", "qwen2.5-0.5b", "qwen3-0.6b", "qwen3-4b", "qwen3.5-0.8b", *gemma
    }
    for name in ("llama3.2-1b", "llama3.2-3b"):
        assert PRESETS[name].rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    for name in ("llama3.1-8b", "llama3.1-70b"):
        assert PRESETS[name].rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
        assert PRESETS[name].rope_theta == 500_000.0
    llama3 = {"llama3.2-1b", "llama3.2-3b", "llama3.1-8b", "llama3.1-70b"}
    assert {n for n, c in PRESETS.items() if c.rope_scaling} == llama3 | {"gemma3-4b", "gpt-oss-20b", "gpt-oss-120b"}
    assert PRESETS["gpt-oss-20b"].rope_scaling == RopeScaling(32.0, original_max_position=4096, rope_type="yarn",
                                                              truncate=False)
    assert PRESETS["gemma3-4b"].rope_scaling == RopeScaling(factor=8.0, rope_type="linear")
    assert PRESETS["qwen3-4b"].head_dim * PRESETS["qwen3-4b"].num_heads != PRESETS["qwen3-4b"].hidden
    assert 2e6 < param_count(PRESETS["tiny"]) < 1e7 and PRESETS["tiny"].compute_dtype == "float32"


def test_overrides_and_replace_revalidate():
    cfg = ModelConfig.from_preset("llama3.1-8b", num_layers=2, remat="full")
    assert (cfg.num_layers, cfg.remat, cfg.hidden) == (2, "full", 4096)
    assert dataclasses.replace(cfg, loss_chunk=1024).loss_chunk == 1024
    with pytest.raises(ValueError, match=r"num_heads \(32\) must be a multiple of num_kv_heads \(6\)"):
        dataclasses.replace(cfg, num_kv_heads=6)
    with pytest.raises(ValueError, match=r"unknown preset 'llama-7b'; choose one of tiny, llama3.2-1b"):
        ModelConfig.from_preset("llama-7b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden = 8


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(num_heads=8, num_kv_heads=3), r"num_heads \(8\) must be a multiple of num_kv_heads \(3\)"),
        (dict(num_layers=0), r"num_layers \(0\) must be a positive integer"),
        (dict(hidden=64.0), r"hidden \(64.0\) must be a positive integer"),
        (dict(head_dim=7), r"head_dim \(7\) must be even for rotary embeddings"),
        (dict(remat="selective"), r"remat 'selective' is not one of none, full, save_matmuls, offload"),
        (dict(loss_chunk=-1), r"loss_chunk \(-1\) must be 0 \(off\) or a positive number"),
        (dict(mlp_chunk=True), r"mlp_chunk \(True\) must be 0 \(off\) or a positive number"),
        (dict(attn_chunk=-1), r"attn_chunk \(-1\) must be 0 \(off\) or a positive number"),
        (dict(compute_dtype="fp8"), r"compute_dtype 'fp8' is not one of float32, bfloat16, float16"),
        (dict(attention_impl=""), r"attention_impl \(''\) must be a non-empty string"),
        (dict(rope_theta=1.0), r"rope_theta \(1.0\) must be > 1"),
        (dict(rope_scaling={"factor": 8}), r"rope_scaling must be a RopeScaling or None, got dict"),
    ],
)
def test_invalid_configs(overrides, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_preset("tiny", **overrides)


def test_invalid_rope_scaling():
    with pytest.raises(ValueError, match=r"0 < low_freq_factor \(4.0\) < high_freq_factor \(1.0\)"):
        RopeScaling(factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0)
    with pytest.raises(ValueError, match=r"rope scaling factor \(0.5\) must be >= 1"):
        RopeScaling(factor=0.5)


def test_flops_hand_count_for_tiny():
    cfg = ModelConfig.from_preset("tiny")  # L=4, D=256, N=8, K=4, H=32, F=768, V=4096
    per_layer = 256 * 8 * 32 + 2 * 256 * 4 * 32 + 8 * 32 * 256 + 3 * 256 * 768  # q, k+v, o, MLP = 786,432
    assert per_layer == 786_432
    assert matmul_params(cfg) == 4 * 786_432 + 4096 * 256 == 4_194_304  # + the unembedding matmul
    # batch 2 x 1024 tokens, causal: 6 * 4,194,304 * 2048 + 12 * 4 * 2 * 1024^2 * 8 * 32 / 2
    dense, attention = 6 * 4_194_304 * 2048, 12 * 4 * 2 * 1024**2 * 8 * 32 // 2
    assert (dense, attention) == (51_539_607_552, 12_884_901_888)
    assert training_flops(cfg, batch=2, seq_len=1024) == 64_424_509_440
    assert training_flops(cfg, batch=2, seq_len=1024, causal=False) == dense + 2 * attention
    assert flops_per_device(cfg, batch=2, seq_len=1024, n_devices=8) == 64_424_509_440 / 8
    assert flops_per_token(cfg, 1024) == 64_424_509_440 / 2048


def test_flops_count_each_document_apart_and_what_lora_performs():
    """Packed rows: each document's causal pairs (a row of four 8K documents holds a quarter of one 32K document's
    attention), padding none; the batch's segment ids give the same count. LoRA: 4 P_mm (no frozen weight gradient)
    plus 6 r (in + out) per adapter, hand-counted for tiny."""
    import dataclasses

    import numpy as np

    from ulysses_jax.model.flops import batch_flops_per_device, flops_convention
    from ulysses_jax.model.lora_config import LoraConfig

    cfg = ModelConfig.from_preset("tiny")
    dense = 6 * matmul_params(cfg) * 1024
    one = training_flops(cfg, batch=1, seq_len=1024)
    four = training_flops(cfg, batch=1, seq_len=1024, document_lengths=[[256] * 4])
    assert one - dense == 4 * (four - dense) == 12 * 4 * 1024**2 / 2 * 8 * 32
    assert training_flops(cfg, batch=1, seq_len=1024, document_lengths=[[1024]]) == one
    seg = np.repeat(np.arange(1, 5), 256)[None].astype(np.int32)
    padded = np.where(np.arange(1024) < 768, seg, 0)  # three documents, then padding: no attention counted there
    assert batch_flops_per_device(cfg, seg, global_batch=1, n_devices=8) == four / 8
    assert batch_flops_per_device(cfg, padded, global_batch=1, n_devices=1) == pytest.approx(dense + 3 / 4 * (
        four - dense))
    with pytest.raises(ValueError, match="document_lengths has 1 rows but batch is 2"):
        training_flops(cfg, batch=2, seq_len=1024, document_lengths=[[1024]])
    lora = dataclasses.replace(cfg, lora=LoraConfig(rank=4, targets="q,down"))
    adapters = 4 * 4 * ((256 + 8 * 32) + (768 + 256))  # 4 layers, rank 4, q: 256 -> 256, down: 768 -> 256
    want = 4 * matmul_params(cfg) * 1024 + 6 * adapters * 1024 + (one - dense)
    assert training_flops(lora, batch=1, seq_len=1024) == want
    assert "LoRA: the FLOPs performed" in flops_convention(lora) and "LoRA" not in flops_convention(cfg)


def test_flops_of_llama3_8b_at_128k():
    """The attention term grows with context: at 128K tokens it is ~2.3x the dense term for Llama-3.1-8B."""
    cfg = ModelConfig.from_preset("llama3.1-8b")
    dense = 6 * matmul_params(cfg)
    attention = 12 * 32 * 32 * 128 * 131072 / 2
    assert flops_per_token(cfg, 131072) == pytest.approx(dense + attention)
    assert 2.2 < attention / dense < 2.4


def test_peak_and_mfu():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("cpu") is None
    assert mfu(494.5e12, 1.0, 989e12) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="must be positive"):
        mfu(1.0, 0.0, 989e12)


def test_flops_count_the_window_of_local_layers():
    """gemma3-4b at 128K: 29 local layers count S*W - W^2/2 pairs (W = 1024), 5 global ones S^2/2; the window
    cuts the attention term by more than 5x. Parameters: the published 3.88B of the text model (tied)."""
    from ulysses_jax.model.flops import attention_pairs, param_count

    cfg = ModelConfig.from_preset("gemma3-4b")
    s, w = 131072, 1024
    pairs = 29 * (s * w - w * w / 2) + 5 * s * s / 2
    assert attention_pairs(s, w) == s * w - w * w / 2 and attention_pairs(s, None) == s * s / 2
    assert attention_pairs(512, w) == 512 * 512 / 2  # a window longer than the sequence is no window
    want = 6 * matmul_params(cfg) * s + 12 * pairs * 8 * 256
    assert training_flops(cfg, batch=1, seq_len=s) == pytest.approx(want)
    every_global = 6 * matmul_params(cfg) * s + 12 * 34 * s * s / 2 * 8 * 256
    assert (every_global - 6 * matmul_params(cfg) * s) / (want - 6 * matmul_params(cfg) * s) > 5
    assert 3.8e9 < param_count(cfg) < 3.95e9
    assert 0.99e9 < param_count(ModelConfig.from_preset("gemma3-1b")) < 1.01e9


@pytest.mark.parametrize("overrides, match", [
    (dict(sliding_window=-4), r"sliding_window \(-4\) must be 0 \(no local layers\)"),
    (dict(layer_pattern=("sliding",)), r"layer_pattern has 'sliding', an unknown layer type"),
    (dict(mlp_activation="relu"), r"mlp_activation 'relu' is not one of 'silu', 'gelu_tanh'"),
])
def test_invalid_layer_settings(overrides, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_preset("tiny", **overrides)


def test_kept_attention_is_not_offloaded_from_mixed_layer_kinds():
    """XLA cannot offload the kept attention outputs from inside the switch between a model's attention kinds (the
    compile for H100s fails in layout assignment): refused in one line, and --memory auto skips that set."""
    from ulysses_jax.plan.planner import PlanConfig
    from ulysses_jax.plan.search import memory_choices

    gemma = ModelConfig.from_preset("gemma3-1b")
    with pytest.raises(ValueError, match=r"attn_keep \(--attn-keep\) with remat offload is not available"):
        dataclasses.replace(gemma, remat="offload", attn_keep=True)
    assert dataclasses.replace(gemma, remat="full", attn_keep=True).attn_keep  # kept on the device: fine
    skipped = {f: why for f, _, why in memory_choices(PlanConfig(), 26, mixed_kinds=True) if why}
    assert any("--remat offload --attn-keep" in f for f in skipped), skipped
    # a hybrid (delta-net and attention layers) switches between kinds too: the same refusal (plan --memory auto
    # on qwen3.5-9b used to try the set and crash)
    hybrid = ModelConfig.from_preset("qwen3.5-9b")
    assert hybrid.mixed_layer_kinds and gemma.mixed_layer_kinds
    assert not ModelConfig.from_preset("llama3.2-1b").mixed_layer_kinds
    with pytest.raises(ValueError, match=r"mixes layer kinds \(local, global or linear layers\)"):
        dataclasses.replace(hybrid, remat="offload", attn_keep=True)
    # its gated attention runs in the tiled sublayer too (tests/test_model.py): --memory auto tries those sets
    gated = memory_choices(PlanConfig(), 32, 4096, mixed_kinds=True, delta=True)
    tiled = [(f, c) for f, c, _ in gated if "--attn-chunk" in f]  # with the delta-net in groups of one value head
    assert tiled and all("--delta-head-chunk 1" in f and c["delta_head_chunk"] == 1 for f, c in tiled)
    assert all(why is None for f, _, why in gated if "offload --attn-keep" not in f)
    assert dataclasses.replace(hybrid, attn_chunk=4096).attn_chunk == 4096
    with pytest.raises(ValueError, match=r"takes an output gate \(attn_output_gate\) or a post-attention norm "
                                         r"\(post_norms\), not both; use attn_chunk 0"):
        dataclasses.replace(hybrid, attn_chunk=4096, post_norms=True)


def test_hybrid_flops_count_the_delta_rule_and_each_layers_own_mixer():
    """Qwen3.5-9B: attention's quadratic term over its 8 full layers only; the delta rule linear in S (the kernel's
    own count per value head); projections of each kind in its own layers."""
    from ulysses_jax.kernels.gated_delta import gated_delta_flops
    from ulysses_jax.model.flops import attention_matmul_params, delta_matmul_params, delta_rule_flops

    cfg = ModelConfig.from_preset("qwen3.5-9b")
    s = 65_536
    rule = 24 * 32 * gated_delta_flops(s, 128, 128, value_per_key=2, backward=True)
    assert delta_rule_flops(cfg, s) == rule
    per_layer = (8 * attention_matmul_params(cfg) + 24 * delta_matmul_params(cfg)) / 32
    assert attention_matmul_params(cfg) == 4096 * 16 * 256 * 2 + 2 * 4096 * 4 * 256 + 16 * 256 * 4096  # q gated
    assert math.isclose(matmul_params(cfg), 32 * (per_layer + 3 * 4096 * 12_288) + 248_320 * 4096)
    attention = 12 * 8 * s * s / 2 * 16 * 256
    assert math.isclose(training_flops(cfg, batch=1, seq_len=s), 6 * matmul_params(cfg) * s + attention + rule)
