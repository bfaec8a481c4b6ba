"""Logit parity with transformers for the sliding-window families (Gemma 3 text, windowed Mistral and Qwen2): tiny
random models made by transformers, imported on 1 device and on fsdp=2 x sp=4 (8 fake CPU devices), float32.

    python experiments/hf_parity_windows.py      # writes experiments/results/hf_parity_windows.md

The same models as tests/test_hf.py's parity cases (which assert the 1e-4 bound); this records the figures.
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from results_io import run_header, write_table  # noqa: E402  (beside this script)

import ulysses_jax as uj  # noqa: E402
from ulysses_jax.interop import hf  # noqa: E402

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
CASES = {
    "Gemma 3 (local, local, global; window 5)": ("Gemma3TextConfig", dict(
        num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=5,
        query_pre_attn_scalar=24, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}})),
    "Mistral (window 5 on every layer)": ("MistralConfig", dict(rope_theta=1e6, sliding_window=5)),
    "Qwen2 (window 5 from layer 1)": ("Qwen2Config", dict(rope_theta=1e6, use_sliding_window=True, sliding_window=5,
                                                          max_window_layers=1, tie_word_embeddings=True)),
}
S = 32


def main() -> int:
    rows = []
    for name, (cls, settings) in CASES.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**SMALL, **settings}))
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                p.copy_((1.0 if pname.endswith("norm.weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))
        tokens = np.random.default_rng(0).integers(0, 96, (2, S))
        with torch.no_grad():
            ref = model.eval()(torch.tensor(tokens)).logits.numpy()
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            row = {"model": name}
            for label, mesh in (("1 device", uj.make_mesh(fsdp=1, sp=1, devices=jax.devices()[:1])),
                                ("fsdp=2 x sp=4", uj.make_mesh(fsdp=2, sp=4))):
                ours = hf.from_hf(tmp, mesh=mesh, compute_dtype="float32", attention_impl="xla")
                logits = np.asarray(jax.jit(lambda t, m=ours: m(t))(tokens))
                row[f"max abs logit error, {label}"] = f"{np.abs(logits - ref).max():.2e}"
            row["max abs logit"] = f"{np.abs(ref).max():.2f}"
        rows.append(row)
        print(row, flush=True)
    meta = run_header(hardware="CPU (8 fake devices), float32; transformers " + transformers.__version__)
    out = os.path.join(os.path.dirname(__file__), "results", "hf_parity_windows")
    write_table(out, "Logit parity with transformers: sliding-window families", meta, list(rows[0]), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
