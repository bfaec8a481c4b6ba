"""Hugging Face folders through the CLI: train --init-from-hf, resume and eval with no other flag, export, and
transformers loading the export (no missing or unexpected weight, the same logits); step 0 is the folder's model
exactly; a preset run exports too; SFT jsonl in training (hand-checked labels) and every refusal (exit 2, one line,
nothing written)."""

import dataclasses
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from ulysses_jax.cli import main
from ulysses_jax.train.devices import MeshConfig

try:
    import tokenizers
    import torch
    import transformers
except ImportError:  # CI must run these: there a missing install fails instead of skipping
    if os.environ.get("CI"):
        raise
    pytest.skip("needs torch and transformers: pip install -e '.[test]'", allow_module_level=True)
transformers.utils.logging.disable_progress_bar()

SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = ["the", "sky", "is", "blue", ".", "user", "assistant", "hi", "hello", "there", "alpha", "beta", "gamma",
         "delta", "token", "device", "shard", "ring", "mesh", "step"]
VOCAB = 64  # the model's; the tokenizer has 25 tokens (a padded embedding, as published models have)
CHATML = ("{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
FLAGS = ["--seq-len", "64", "--attention", "xla", "--mesh.fsdp", "2", "--mesh.sp", "4", "--no-progress"]
TOL = 1e-4  # float32 logits, absolute


def random_weights(model, seed: int, scale: float = 0.1, scale_of=lambda name: None):
    """``model`` with every parameter drawn anew: norm scales ``1 + scale * N(0, 1)``, the others ``scale * N(0, 1)``
    (``scale_of(name)``, when not None, overrides ``scale`` for a parameter)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            s = scale_of(name) or scale
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + s * torch.randn(p.shape, generator=gen))
    return model


def make_folder(path: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A tiny random Llama saved by transformers, with a word-level tokenizer.json, BOS/EOS and a chat template."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        rope_theta=10_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = random_weights(transformers.AutoModelForCausalLM.from_config(config).eval(), seed)
    model.save_pretrained(path)
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": CHATML}))
    return path


def write_corpus(path: pathlib.Path, n: int = 40, seed: int = 0) -> pathlib.Path:
    rng = np.random.default_rng(seed)
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS, int(rng.integers(10, 60))))}) + "\n"
                            for _ in range(n)))
    return path


def cli(*args, check=True):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the CLI picks its own fake devices
    proc = subprocess.run([sys.executable, "-m", "ulysses_jax", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600)
    if check and proc.returncode:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def refused(capsys, args, *needles):
    """``main(args)`` exits 2 with one line on stderr holding every needle, and no traceback."""
    capsys.readouterr()
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def load_quietly(folder):
    """transformers' model of ``folder`` and what it logged: nothing may be missing, unexpected or new."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = transformers.utils.logging.get_logger("transformers")
    logger.addHandler(handler)
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    finally:
        logger.removeHandler(handler)
    assert {k: v for k, v in info.items() if len(v)} == {}, info
    text = " ".join(r.getMessage() for r in records).lower()
    assert not any(w in text for w in ("missing", "unexpected", "newly initialized", "not used")), text
    return model.eval()


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def our_logits(run_dir, step, tokens):
    """Our float32 logits from the run's checkpoint ``step`` (the model and mesh as eval builds them)."""
    from ulysses_jax.train import runconfig
    from ulysses_jax.train.checkpoint import Checkpointer
    from ulysses_jax.train.config import model_config_from_run
    from ulysses_jax.train.devices import build_mesh
    from ulysses_jax.train.step import abstract_state

    record = runconfig.read_record(run_dir)
    cfg = model_config_from_run(record, compute_dtype="float32", attention_impl="xla")
    mesh = build_mesh(MeshConfig(fsdp=2, sp=4), cfg, tokens.shape[1])
    graphdef, target = abstract_state(cfg, mesh)
    ckpt = Checkpointer(run_dir, create=False)
    try:
        state, _ = ckpt.restore(step, target, params_only=True)
    finally:
        ckpt.close()
    model = nnx.merge(graphdef, state["params"])
    return np.asarray(jax.jit(lambda t: model.logits(model.hidden_states(t, None, None)))(tokens))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("hf") / "tiny-llama")


def test_init_from_hf_resume_eval_export_load(folder, tmp_path, capsys):
    """The whole path (the first run through the real entry point): resume and eval read everything from the run."""
    corpus, run, out = write_corpus(tmp_path / "corpus.jsonl"), tmp_path / "run", tmp_path / "export"
    first = cli("train", "--init-from-hf", folder, "--data", corpus, "--eval-fraction", "0.2", "--steps", "2",
                "--checkpoint-every", "1", "--run-dir", run, *FLAGS)
    assert "Training tiny-llama (2 layers, hidden 64, 4/2 heads)" in first.stdout, first.stdout
    capsys.readouterr()
    record = json.loads((run / "run.json").read_text())
    assert record["config"]["init_from_hf"] == str(folder.resolve()) and record["config"]["preset"] is None
    assert record["config"]["tokenizer"] == str(folder.resolve() / "tokenizer.json")
    assert record["init_from_hf"]["path"] == str(folder.resolve()) and record["model"]["vocab_size"] == VOCAB

    assert main(["train", "--run-dir", str(run), "--resume", "--steps", "3"]) == 0  # nothing else: the run remembers
    assert f"Continuing {run} from step 2" in capsys.readouterr().out
    assert main(["eval", "--run-dir", str(run), "--max-batches", "1", "--mesh.fsdp", "2", "--mesh.sp", "4"]) == 0
    assert "eval at step 3" in capsys.readouterr().out

    # a changed folder is another run: refused on resume
    moved = shutil.copytree(folder, tmp_path / "other")
    cfg = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-6}))
    refused(capsys, ["train", "--run-dir", run, "--resume", "--steps", "4", "--init-from-hf", moved],
            "cannot continue", "is not the run's folder")

    assert main(["export", "--run-dir", str(run), "--out", str(out)]) == 0
    done = capsys.readouterr().out
    assert "Exported step 3" in done and "LlamaForCausalLM" in done, done
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    loaded = load_quietly(out)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 32))
    theirs, ours = hf_logits(loaded, tokens), our_logits(run, 3, tokens)
    assert np.abs(ours - theirs).max() <= TOL, np.abs(ours - theirs).max()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name

    # export refuses a folder that is not empty, a missing step and a run without checkpoints
    refused(capsys, ["export", "--run-dir", run, "--out", out], "is not an empty folder")
    refused(capsys, ["export", "--run-dir", run, "--out", tmp_path / "new", "--step", "7"], "--step 7", "steps: ")
    (tmp_path / "empty-run").mkdir()
    shutil.copy(run / "run.json", tmp_path / "empty-run" / "run.json")
    refused(capsys, ["export", "--run-dir", tmp_path / "empty-run", "--out", tmp_path / "new"], "no checkpoint")
    assert not (tmp_path / "new").exists()


def test_step_zero_is_the_folders_model_exactly(folder, tmp_path):
    """Before any step the parameters are the folder's tensors bit for bit, in their shardings on the run's mesh
    (the state ``setup_train`` builds at step 0: its model config, its mesh, the weights read into place)."""
    from safetensors.numpy import load_file

    from ulysses_jax.interop import hf
    from ulysses_jax.train.config import TrainConfig, model_config
    from ulysses_jax.train.devices import build_mesh
    from ulysses_jax.train.step import OptimConfig, abstract_state, init_state, make_optimizer
    from ulysses_jax.train.trainer import _hf_weights

    cfg = TrainConfig(init_from_hf=str(folder), seq_len=64, attention="xla", mesh=MeshConfig(fsdp=2, sp=4))
    config = model_config(cfg, len(SPECIAL + WORDS))
    mesh = build_mesh(cfg.mesh, config, cfg.seq_len)
    tx = make_optimizer(OptimConfig().resolved(1), 1)
    _, state = init_state(config, mesh, tx, 0, model=_hf_weights(str(folder), config, mesh))
    params = state["params"]
    at_rest = abstract_state(config, mesh)[1]["params"]  # the shardings of a fresh model on the run's mesh
    assert jax.tree.leaves(jax.tree.map(lambda x, a: x.sharding == a.sharding, params, at_rest)) != []
    assert all(jax.tree.leaves(jax.tree.map(lambda x, a: x.sharding == a.sharding, params, at_rest)))
    graphdef = nnx.split(hf.from_hf(folder, mesh=mesh, compute_dtype="float32"))[0]
    model = nnx.merge(graphdef, params)
    hf.to_hf(model, tmp_path / "step0")
    theirs, ours = load_file(folder / "model.safetensors"), load_file(tmp_path / "step0" / "model.safetensors")
    assert theirs.keys() == ours.keys()
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    tokens = np.random.default_rng(1).integers(0, VOCAB, (1, 24))
    original = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    np.testing.assert_array_equal(hf_logits(load_quietly(tmp_path / "step0"), tokens), hf_logits(original, tokens))


def test_a_preset_run_exports(tmp_path, capsys):
    """A preset run on UTF-8 bytes: config.json of LlamaForCausalLM, no tokenizer files, same logits."""
    run, out = tmp_path / "run", tmp_path / "export"
    assert main(["train", "--preset", "tiny", "--steps", "1", "--data", str(write_corpus(tmp_path / "c.jsonl")),
                 "--run-dir", str(run), *FLAGS]) == 0
    assert main(["export", "--run-dir", str(run), "--out", str(out)]) == 0
    assert "no tokenizer files" in capsys.readouterr().out
    assert not (out / "tokenizer.json").exists()
    loaded = load_quietly(out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 4096
    tokens = np.frombuffer(b"the sky is blue. " * 4, np.uint8).astype(np.int64)[:64].reshape(2, 32)
    assert np.abs(our_logits(run, 1, tokens) - hf_logits(loaded, tokens)).max() <= TOL


def compute(run):
    return json.loads((pathlib.Path(run) / "run.json").read_text())["compute"]


@pytest.mark.parametrize("kind", ["preset", "hf"])
def test_resume_merges_flags_the_same_for_presets_and_folders(kind, folder, tmp_path):
    """What ``train --resume`` resolves (no step run): the run's record, this invocation's flags over it, one model
    resolution for a preset and a folder; an explicit ``--no-...`` counts, a tool switched off takes its options."""
    from ulysses_jax.cli import parse
    from ulysses_jax.train import runconfig
    from ulysses_jax.train.config import COMPUTE_ONLY, TrainConfig, model_config

    run = tmp_path / "run"
    start = TrainConfig(**({"preset": "tiny"} if kind == "preset" else {"preset": None, "init_from_hf": str(folder)}),
                        seq_len=64, attn_chunk=8, attn_head_chunk=1, attn_recompute=True, param_dtype="bfloat16")
    model = dataclasses.asdict(model_config(start, 0))
    record = {"version": 1, "config": runconfig.to_dict(start, skip=runconfig.PER_INVOCATION),
              "model": {k: v for k, v in model.items() if k not in COMPUTE_ONLY},
              "compute": {k: model[k] for k in COMPUTE_ONLY}, "init_from_hf": {"path": str(folder)}}
    runconfig.write_record(run, record)

    def resumed(*flags):
        cfg = parse(["train", "--run-dir", str(run), "--resume", *flags])
        m = model_config(cfg, 0, record=record)
        return (m.attn_chunk, m.attn_head_chunk, m.attn_recompute, m.param_dtype, m.offload_params)

    assert resumed() == (8, 1, True, "bfloat16", False)
    assert resumed("--no-attn-recompute") == (8, 1, False, "bfloat16", False)
    assert resumed("--attn-chunk", "16") == (16, 1, True, "bfloat16", False)
    assert resumed("--attn-chunk", "0") == (0, 0, False, "bfloat16", False)
    assert resumed("--attn-chunk=0", "--remat", "full") == (0, 0, False, "bfloat16", False)
    assert resumed("--param-dtype", "float32") == (8, 1, True, "float32", False)  # then refused as another model
    (tmp_path / "c.yaml").write_text("attn_chunk: 0\n")
    assert resumed("--config", str(tmp_path / "c.yaml")) == (0, 0, False, "bfloat16", False)
    with pytest.raises(ValueError, match=r"--attn-head-chunk \(1\) groups the heads .* add --attn-chunk"):
        resumed("--attn-chunk", "0", "--attn-head-chunk", "1")  # given anew: refused, as on a new run
    assert runconfig.drop_qualifiers(dataclasses.replace(start, remat="none", remat_every=2, eval_every=0,
                                                         eval_passkey=True, eval_passkey_samples=3),
                                     {"remat", "eval_every"}) == dataclasses.replace(start, remat="none", eval_every=0)
    assert runconfig.drop_qualifiers(dataclasses.replace(start, eval_every=5, eval_passkey_samples=3),
                                     {"eval_passkey"}) == dataclasses.replace(start, eval_every=5)
    kept = dataclasses.replace(start, remat="full", remat_every=2, eval_every=5, eval_by_position=True)
    assert runconfig.drop_qualifiers(kept, {"remat", "eval_every"}) == kept  # the tools stay on: so do their options
    nested = dataclasses.replace(start, remat="full", remat_every=2, remat_nested=True)  # --remat full on a nested run
    assert runconfig.drop_qualifiers(nested, {"remat"}) == dataclasses.replace(nested, remat_nested=False)
    # --no-fp8 on a delayed-recipe run: the recipe goes with it (then the resume names fp8, the setting that differs;
    # before, the refusal named --fp8-recipe, a flag this command did not give: found by a review)
    # the kept MLP products (and attention output) go with a tool that leaves them nothing to do, as on eval
    mlp = dataclasses.replace(start, remat="full", mlp_chunk=0, attn_keep=True, mlp_keep=True)
    for tool, value in (("mlp_chunk", 64), ("remat", "offload"), ("remat", "save_matmuls"), ("remat_every", 2)):
        assert runconfig.drop_qualifiers(dataclasses.replace(mlp, **{tool: value}), {tool}) == dataclasses.replace(
            mlp, **{tool: value}, mlp_keep=False), tool
    assert runconfig.drop_qualifiers(mlp, {"remat", "mlp_chunk"}) == mlp
    assert runconfig.drop_qualifiers(dataclasses.replace(mlp, attn_chunk=64), {"attn_chunk"}).attn_keep is False
    delayed = dataclasses.replace(start, fp8=False, fp8_recipe="delayed")
    assert runconfig.drop_qualifiers(delayed, {"fp8"}) == dataclasses.replace(delayed, fp8_recipe="current")
    assert runconfig.given_settings(TrainConfig, ["--no-attn-recompute", "--optim.no-master-weights", "--mesh.sp=4",
                                                  "--attn_chunk", "0", "--steps", "--resume"]) == {
        "attn_recompute", "optim.master_weights", "mesh.sp", "attn_chunk", "steps", "resume"}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["preset", "hf"])
def test_resume_flags_are_the_same_for_presets_and_folders(kind, folder, tmp_path, capsys):
    """The tiled attention's switches on resume, for a preset run and a run from a folder alike: a flag the run was
    started with holds, ``--no-attn-recompute`` is honoured, ``--attn-chunk 0`` switches the tiled attention off with
    the options the run gave it, and an option given anew without the tool is refused."""
    run = tmp_path / "run"
    model = ["--preset", "tiny"] if kind == "preset" else ["--init-from-hf", folder]
    assert main([str(a) for a in ["train", *model, "--data", write_corpus(tmp_path / "c.jsonl"), "--steps", "1",
                                  "--run-dir", run, *FLAGS, "--attn-chunk", "8", "--attn-head-chunk", "1",
                                  "--attn-recompute"]]) == 0
    tiled = {"attn_chunk": 8, "attn_head_chunk": 1, "attn_recompute": True}
    assert {k: compute(run)[k] for k in tiled} == tiled
    cli("train", "--run-dir", run, "--resume", "--steps", "2", "--no-attn-recompute")  # the real entry point
    assert {k: compute(run)[k] for k in tiled} == {**tiled, "attn_recompute": False}
    assert main(["train", "--run-dir", str(run), "--resume", "--steps", "3", "--attn-chunk", "0"]) == 0
    assert {k: compute(run)[k] for k in tiled} == {"attn_chunk": 0, "attn_head_chunk": 0, "attn_recompute": False}
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    refused(capsys, ["train", "--run-dir", run, "--resume", "--steps", "4", "--attn-head-chunk", "1"],
            "--attn-head-chunk (1) groups the heads of the tiled attention sublayer; add --attn-chunk")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_master_weights_run_exports_its_float32_masters(tmp_path, capsys):
    """--param-dtype bfloat16 --optim.master-weights (with --grad-accum 2: float32 sums): `export --dtype float32`
    writes the float32 masters (not the bfloat16 parameters), `--dtype bfloat16` the parameters; resuming without
    master weights is refused by name."""
    from safetensors.numpy import load_file

    from ulysses_jax.interop import hf
    from ulysses_jax.train import runconfig
    from ulysses_jax.train.checkpoint import Checkpointer
    from ulysses_jax.train.config import model_config_from_run
    from ulysses_jax.train.devices import build_mesh
    from ulysses_jax.train.step import OptimConfig, abstract_state, make_optimizer

    run = tmp_path / "run"
    cli("train", "--preset", "tiny", "--steps", "2", "--data", write_corpus(tmp_path / "c.jsonl"), "--run-dir", run,
        *FLAGS, "--param-dtype", "bfloat16", "--optim.master-weights", "--grad-accum", "2", "--batch-size", "4")
    cli("export", "--run-dir", run, "--out", tmp_path / "f32", "--dtype", "float32")
    assert main(["export", "--run-dir", str(run), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    # the masters as the full train state holds them (moments and all), written by the same writer
    record = runconfig.read_record(run)
    model = model_config_from_run(record)
    mesh = build_mesh(MeshConfig(), model, record["seq_len"])
    graphdef, target = abstract_state(model, mesh, make_optimizer(OptimConfig(master_weights=True).resolved(2), 2))
    ckpt = Checkpointer(run, create=False)
    try:
        state, _ = ckpt.restore(2, target)
    finally:
        ckpt.close()
    hf.to_hf(nnx.merge(graphdef, state["opt_state"].master), tmp_path / "want", dtype="float32")
    f32, want, bf16 = (load_file(tmp_path / d / "model.safetensors") for d in ("f32", "want", "bf16"))
    assert f32.keys() == want.keys() == bf16.keys()
    rounded = 0
    for name in want:
        assert f32[name].dtype == np.float32, name
        np.testing.assert_array_equal(f32[name], want[name], err_msg=name)
        # the bfloat16 export is the parameters: the masters rounded once
        np.testing.assert_array_equal(bf16[name], want[name].astype(bf16[name].dtype), err_msg=name)
        rounded += int((want[name].astype(bf16[name].dtype).astype(np.float32) != want[name]).sum())
    assert rounded > 0  # the masters are not bfloat16 values: writing the parameters would differ
    assert json.loads((tmp_path / "f32" / "config.json").read_text())["torch_dtype"] == "float32"
    capsys.readouterr()
    refused(capsys, ["train", "--run-dir", run, "--resume", "--steps", "3", "--optim.no-master-weights"],
            "--optim.master-weights is False here but True in the run")


def test_preset_and_init_from_hf_exclude_each_other(folder, tmp_path, capsys):
    refused(capsys, ["train", "--preset", "tiny", "--init-from-hf", folder, "--run-dir", tmp_path / "r"],
            "--preset and --init-from-hf exclude each other")
    (tmp_path / "run.yaml").write_text("preset: llama3.1-8b\n")
    refused(capsys, ["plan", "--config", tmp_path / "run.yaml", "--init-from-hf", folder],
            "--preset and --init-from-hf exclude each other")
    assert not (tmp_path / "r").exists()
    # the folder's config.json decides the local layers (before: both model configs printed whole, 4,000 characters)
    refused(capsys, ["train", "--init-from-hf", folder, "--sliding-window", "8", "--run-dir", tmp_path / "r"],
            "--sliding-window (8) cannot change a model that --init-from-hf imports: its local layers come from the "
            "folder's config.json; drop the flag")
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------------ SFT


def test_sft_labels_hand_checked(folder, tmp_path):
    """Packed SFT rows: a label counts only where the next token is a completion (or assistant) token."""
    from ulysses_jax.data.documents import IGNORE, DataConfig
    from ulysses_jax.data.pipeline import BatchIterator

    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "the sky is", "completion": "blue ."}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "hello there"}]}) + "\n")
    cfg = DataConfig(paths=(str(data),), tokenizer=str(folder), format="sft", eval_fraction=0.0, shuffle=False)
    row = next(BatchIterator(cfg, seq_len=32, global_batch=1, seed=0))
    ids = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    words = "<s> the sky is blue . </s> <|im_start|> user hi <|im_end|> <|im_start|> assistant hello there <|im_end|>"
    doc = [ids[w] for w in words.split()]
    # 16 tokens: the row holds the two documents, then (training repeats the data) the two again
    np.testing.assert_array_equal(row["tokens"][0], doc * 2)
    np.testing.assert_array_equal(row["segment_ids"][0], [1] * 7 + [2] * 9 + [3] * 7 + [4] * 9)
    # document 1: <s> the sky -> masked (their next tokens are the prompt); is -> blue, blue -> ., . -> </s>
    # document 2: only "assistant" (-> hello), hello (-> there) and there (-> <|im_end|>) count
    x = IGNORE
    expected = [x, x, x, ids["blue"], ids["."], ids["</s>"], x,
                x, x, x, x, x, ids["hello"], ids["there"], ids["<|im_end|>"], x]
    np.testing.assert_array_equal(row["labels"][0], expected * 2)
    # in the prompt/completion document, the labels masked out are exactly the prompt's tokens (after <s>)
    first = doc[:7]
    assert [first[t + 1] for t in range(6) if expected[t] == IGNORE] == [ids["the"], ids["sky"], ids["is"]]


def test_sft_training_runs_and_bad_lines_are_refused(folder, tmp_path, capsys):
    data = tmp_path / "sft.jsonl"
    rng = np.random.default_rng(0)
    lines = [{"prompt": " ".join(rng.choice(WORDS, 6)), "completion": " ".join(rng.choice(WORDS, 4))}
             for _ in range(12)]
    lines += [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}] * 4
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = tmp_path / "run"
    assert main(["train", "--init-from-hf", str(folder), "--data-format", "sft", "--data", str(data), "--steps", "2",
                 "--eval-fraction", "0", "--run-dir", str(run), *FLAGS]) == 0
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(np.isfinite(m["loss"]) for m in metrics)
    assert 0 < metrics[0]["tokens"] < 2 * 64 // 2  # answers only: fewer than half the tokens count
    assert json.loads((run / "run.json").read_text())["config"]["data_format"] == "sft"

    bad = tmp_path / "bad.jsonl"
    for record, needle in (
        ({"prompt": "hi"}, "is not an SFT record"),
        ({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]}, "role 'robot'"),
    ):
        bad.write_text(json.dumps(lines[0]) + "\n" + json.dumps(record) + "\n")
        refused(capsys, ["train", "--init-from-hf", folder, "--data-format", "sft", "--data", bad, "--run-dir",
                         tmp_path / "no-run", *FLAGS], f"line 2 of --data file {bad}", needle)
    plain = shutil.copytree(folder, tmp_path / "no-template")
    (plain / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    bad.write_text(json.dumps(lines[-1]) + "\n")
    refused(capsys, ["train", "--init-from-hf", plain, "--data-format", "sft", "--data", bad, "--run-dir",
                     tmp_path / "no-run", *FLAGS], "line 1 of --data file", "has no chat template")
    assert not (tmp_path / "no-run").exists()


def test_plan_reads_the_folders_config_only(tmp_path):
    """``plan --init-from-hf``: a folder holding config.json alone is the model (Llama-3.1-8B's published values)."""
    import dataclasses

    from ulysses_jax.model.config import PRESETS
    from ulysses_jax.plan.planner import PlanConfig, _model

    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
        max_position_embeddings=131072, tie_word_embeddings=False, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192))))
    model = _model(PlanConfig(init_from_hf=str(tmp_path / "llama"), remat="offload"))
    assert dataclasses.replace(model, name="llama3.1-8b") == dataclasses.replace(PRESETS["llama3.1-8b"],
                                                                                 remat="offload")
