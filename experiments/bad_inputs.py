"""Bad inputs to the real entry point: each must give exit status 2 (usage or input error), one line on stderr
beginning "error:", no traceback, and write nothing (no new run directory; an existing run's files unchanged).

    python experiments/bad_inputs.py [--out experiments/results/bad_inputs]

Makes a small real run first (tiny preset, 2 steps, 256-token rows) so that resume, eval and checkpoint mistakes
have a run to get wrong, a copy of it with a truncated checkpoint, a copy without checkpoints (as if killed before the
first), and a Hugging Face folder exported from it with a one-step ``--init-from-hf`` run whose config.json is then
edited; then tries every case in its own process on 8 fake CPU devices.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import sysconfig
import tempfile
import time

import tokenizers
from results_io import run_header, write_table

STDLIB = sysconfig.get_paths()["stdlib"]  # the built-in corpus: named as $STDLIB in the results
RUN = ["--preset", "tiny", "--seq-len", "256", "--batch-size", "2", "--mesh.fsdp", "2", "--mesh.sp", "4",
       "--no-progress"]


def cli(*args, timeout=900):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    t = time.time()
    p = subprocess.run([sys.executable, "-m", "ulysses_jax", *args], capture_output=True, text=True, env=env,
                       check=False, timeout=timeout)
    return p, time.time() - t


def snapshot(root: pathlib.Path) -> dict:
    """path -> sha256 of every file under root (missing root: empty)."""
    if not root.exists():
        return {}
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(root.rglob("*")) if f.is_file()}


def word_tokenizer(folder: pathlib.Path) -> pathlib.Path:
    """A word-level tokenizer.json with BOS/EOS (tokenizer_config.json) in ``folder``: what --data-format sft needs."""
    special = ["<unk>", "<s>", "</s>"]
    words = ["the", "sky", "is", "blue", ".", "hi", "there", "ok"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({t: i for i, t in enumerate(special + words)},
                                                           unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in special])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "add_bos_token": True}))
    return folder


def hf_config(folder: pathlib.Path, base: dict, **changes) -> pathlib.Path:
    """A model folder holding only config.json: ``base`` (the exported tiny model's) with ``changes``."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**base, **changes}))
    return folder


def cases(d: pathlib.Path, run: pathlib.Path) -> list[tuple[str, list[str]]]:
    """(what is wrong, argv) pairs. ``NEW`` in an argv stands for a run directory that must not appear; ``CORRUPT``,
    ``NOCKPT`` and ``HFRUN`` for the runs ``main`` prepares (watched: their files must not change)."""
    w = d / "files"
    w.mkdir()
    tok = word_tokenizer(w / "tok")
    base = json.loads((d / "hf" / "config.json").read_text())  # the tiny model exported as LlamaForCausalLM
    moe = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=32)
    shared = hf_config(w / "moe-shared", base, **moe, shared_expert_intermediate_size=64)
    top_k = hf_config(w / "moe-top-k", base, **{**moe, "num_experts_per_tok": 8})
    int8 = hf_config(w / "gpt-oss-int8", base, architectures=["GptOssForCausalLM"], model_type="gpt_oss",
                     num_local_experts=4, num_experts_per_tok=2, attention_bias=True,
                     quantization_config={"quant_method": "bitsandbytes"})
    layer_type = hf_config(w / "layer-type", base, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                           use_sliding_window=True, sliding_window=8,
                           layer_types=["chunked_attention"] * base["num_hidden_layers"])
    gemma_vl = hf_config(w / "gemma-vl", base, architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3",
                         text_config={}, vision_config={})
    softcap = hf_config(w / "softcap", base, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=30.0)
    short, long = {"prompt": "hi there", "completion": "ok"}, {"prompt": "the sky is blue " * 80, "completion": "."}
    (w / "sft_long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [short] * 10 + [long] * 2))
    (w / "sft_corrupt.jsonl").write_text(json.dumps(short) + '\n{"prompt": "the sky" "completion": "blue"}\n')
    (w / "truncated.jsonl").write_text('{"text": "ok"}\n{"text": "the sky"\n')
    (w / "zero.jsonl").write_text("")
    (w / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    (w / "nofield.jsonl").write_text('{"body": "a document"}\n')
    (w / "empty.jsonl").write_text('{"text": ""}\n{"text": "   "}\n')
    (w / "notes.csv").write_text("a,b\n")
    (w / "emptydir").mkdir()
    (w / "other.jsonl").write_text('{"text": "another corpus entirely"}\n' * 50)
    (w / "tokenizer.model").write_bytes(b"\x0a\x05hello")
    (w / "garbage.json").write_text("{not json")
    (w / "syntax.yaml").write_text("mesh: {sp: 8\n")
    (w / "unknown.yaml").write_text("no_such_setting: 3\n")
    (w / "sft_bad.jsonl").write_text('{"prompt": "hi"}\n')
    return [
        ("unknown preset", ["train", "--preset", "llama9", "--run-dir", "NEW"]),
        ("sequence not divisible by sp", ["train", *RUN, "--seq-len", "250", "--run-dir", "NEW"]),
        ("sp that the devices do not allow", ["train", *RUN, "--mesh.sp", "3", "--run-dir", "NEW"]),
        ("fsdp that does not divide the devices", ["train", *RUN, "--mesh.fsdp", "3", "--run-dir", "NEW"]),
        ("batch not divisible by the batch axes", ["train", *RUN, "--batch-size", "3", "--run-dir", "NEW"]),
        ("data path that does not exist", ["train", *RUN, "--data", str(w / "missing.jsonl"), "--run-dir", "NEW"]),
        ("malformed jsonl line", ["train", *RUN, "--data", str(w / "bad.jsonl"), "--run-dir", "NEW"]),
        ("jsonl without the text field", ["train", *RUN, "--data", str(w / "nofield.jsonl"), "--run-dir", "NEW"]),
        ("only empty documents", ["train", *RUN, "--data", str(w / "empty.jsonl"), "--run-dir", "NEW"]),
        ("unknown file extension", ["train", *RUN, "--data", str(w / "notes.csv"), "--run-dir", "NEW"]),
        ("directory without documents", ["train", *RUN, "--data", str(w / "emptydir"), "--run-dir", "NEW"]),
        ("tokenizer that does not exist", ["train", *RUN, "--tokenizer", str(w / "nope.json"), "--run-dir", "NEW"]),
        ("sentencepiece tokenizer.model", ["train", *RUN, "--tokenizer", str(w / "tokenizer.model"),
                                           "--run-dir", "NEW"]),
        ("tokenizer.json that is not JSON", ["train", *RUN, "--tokenizer", str(w / "garbage.json"),
                                             "--run-dir", "NEW"]),
        ("zero steps", ["train", *RUN, "--steps", "0", "--run-dir", "NEW"]),
        ("negative learning rate", ["train", *RUN, "--optim.lr", "-1", "--run-dir", "NEW"]),
        ("loss chunk not dividing the local sequence", ["train", *RUN, "--loss-chunk", "48", "--run-dir", "NEW"]),
        ("unknown remat policy", ["train", *RUN, "--remat", "sometimes", "--run-dir", "NEW"]),
        ("attention head groups that do not divide a device's heads", ["train", *RUN, "--attn-chunk", "16",
                                                                        "--attn-head-chunk", "3", "--run-dir", "NEW"]),
        ("attention head groups without the tiled attention", ["train", *RUN, "--attn-head-chunk", "2",
                                                               "--run-dir", "NEW"]),
        ("unknown attention implementation", ["train", *RUN, "--attention", "magic", "--run-dir", "NEW"]),
        ("cuDNN attention on CPU devices", ["train", *RUN, "--attention", "cudnn", "--run-dir", "NEW"]),
        ("attention kept without remat", ["train", *RUN, "--attn-keep", "--run-dir", "NEW"]),
        ("attention kept with a ring", ["train", "--preset", "tiny", "--seq-len", "256", "--batch-size", "1",
                                        "--mesh.ring", "2", "--mesh.sp", "4", "--remat", "full", "--attn-keep",
                                        "--no-progress", "--run-dir", "NEW"]),
        ("attention kept with the tiled attention", ["train", *RUN, "--remat", "full", "--attn-keep",
                                                     "--attn-chunk", "32", "--run-dir", "NEW"]),
        ("negative bound on documents per row", ["train", *RUN, "--attn-max-documents", "-1", "--run-dir", "NEW"]),
        ("eval fraction above 1", ["train", *RUN, "--eval-fraction", "1.5", "--run-dir", "NEW"]),
        ("checkpoint every 0 steps", ["train", *RUN, "--checkpoint-every", "0", "--run-dir", "NEW"]),
        ("config file that does not exist", ["train", "--config", str(w / "missing.yaml"), "--run-dir", "NEW"]),
        ("config file with a YAML syntax error", ["train", "--config", str(w / "syntax.yaml"), "--run-dir", "NEW"]),
        ("config file with an unknown setting", ["train", "--config", str(w / "unknown.yaml"), "--run-dir", "NEW"]),
        ("unknown flag", ["train", *RUN, "--learning-rate", "3e-4", "--run-dir", "NEW"]),
        ("unknown command", ["frobnicate"]),
        ("resume of a directory that is not a run", ["train", "--resume", "--run-dir", "NEW"]),
        ("existing run reused without --resume", ["train", *RUN, "--run-dir", str(run)]),
        ("resume with another sequence length", ["train", "--resume", "--run-dir", str(run), "--seq-len", "512",
                                                 "--steps", "4"]),
        ("resume with other data", ["train", "--resume", "--run-dir", str(run), "--steps", "4",
                                    "--data", str(w / "other.jsonl")]),
        ("resume from a checkpoint that does not exist", ["train", "--resume-from", "7", "--run-dir", str(run),
                                                          "--steps", "9"]),
        ("resume of a finished run without more steps", ["train", "--resume", "--run-dir", str(run)]),
        ("eval of a directory that is not a run", ["eval", "--run-dir", "NEW"]),
        ("eval on a source too small to hold a document out", ["eval", "--run-dir", str(run), "--data",
                                                                str(w / "other.jsonl")]),
        ("plan for an unknown GPU", ["plan", "--target", "a100", "--devices", "8"]),
        ("plan with devices the mesh does not multiply to", ["plan", "--devices", "6", "--mesh.sp", "4",
                                                              "--mesh.fsdp", "1"]),
        ("corrupt checkpoint", ["train", "--resume", "--run-dir", "CORRUPT", "--steps", "4"]),
        # issue 20: the memory pool, master weights on resume, plan --memory auto
        ("memory fraction above 1", ["train", *RUN, "--memory-fraction", "1.2", "--run-dir", "NEW"]),
        ("resume with master weights the run did not keep", ["train", "--resume", "--run-dir", str(run), "--steps",
                                                             "4", "--optim.master-weights"]),
        ("plan --memory auto with a negative host budget", ["plan", "--preset", "tiny", "--no-kernels", "--memory",
                                                           "auto", "--host-memory-gib", "-1"]),
        # issue 22: eval --by-position and the passkey task
        ("eval --by-position at a step without a checkpoint", ["eval", "--run-dir", str(run), "--by-position",
                                                               "--steps", "1,7"]),
        ("passkey depth outside [0, 1]", ["eval", "--run-dir", str(run), "--task", "passkey", "--depths", "0,1.5"]),
        ("passkey length over the run's seq_len", ["eval", "--run-dir", str(run), "--task", "passkey",
                                                   "--lengths", "1024"]),
        ("passkey with 0 samples", ["eval", "--run-dir", str(run), "--task", "passkey", "--samples", "0"]),
        ("unknown eval task", ["eval", "--run-dir", str(run), "--task", "needle"]),
        # issue 23: sliding windows and Hugging Face configs ulysses_jax cannot run
        ("negative sliding window", ["train", *RUN, "--sliding-window", "-3", "--run-dir", "NEW"]),
        ("sliding window 0 with local layers", ["train", "--preset", "gemma3-1b", "--sliding-window", "0",
                                                "--run-dir", "NEW"]),
        ("config.json with an unknown layer type", ["train", "--init-from-hf", str(layer_type), "--tokenizer",
                                                    str(tok), "--run-dir", "NEW"]),
        ("Gemma 3 vision-language config.json", ["train", "--init-from-hf", str(gemma_vl), "--tokenizer", str(tok),
                                                 "--run-dir", "NEW"]),
        ("config.json with logit soft-capping", ["train", "--init-from-hf", str(softcap), "--tokenizer", str(tok),
                                                 "--run-dir", "NEW"]),
        # issue 24: SFT records, hints that fit the mistake, resume refusals that say what changed
        ("SFT records longer than --seq-len (refuse)", ["train", *RUN, "--data-format", "sft", "--data",
                                                        str(w / "sft_long.jsonl"), "--tokenizer", str(tok),
                                                        "--run-dir", "NEW"]),
        ("SFT records without --data-format sft", ["train", *RUN, "--data", str(w / "sft_long.jsonl"),
                                                   "--run-dir", "NEW"]),
        ("corrupt JSON line in SFT data", ["train", *RUN, "--data-format", "sft", "--data",
                                           str(w / "sft_corrupt.jsonl"), "--tokenizer", str(tok), "--run-dir", "NEW"]),
        ("jsonl line cut short", ["train", *RUN, "--data", str(w / "truncated.jsonl"), "--run-dir", "NEW"]),
        ("empty data file", ["train", *RUN, "--data", str(w / "zero.jsonl"), "--run-dir", "NEW"]),
        ("restart with other --steps (derived warmup)", ["train", *RUN, "--steps", "20", "--run-dir", "NOCKPT"]),
        ("resume after the --init-from-hf config.json was edited", ["train", "--resume", "--run-dir", "HFRUN",
                                                                     "--steps", "2"]),
        # issues 29-30: mixtures of experts and gpt-oss that are not modelled; issue 32: clusters
        ("MoE config.json with a shared expert", ["train", "--init-from-hf", str(shared), "--tokenizer", str(tok),
                                                  "--run-dir", "NEW"]),
        ("MoE config.json with top-k above the experts", ["train", "--init-from-hf", str(top_k), "--tokenizer",
                                                          str(tok), "--run-dir", "NEW"]),
        ("gpt-oss config.json quantised other than MXFP4", ["train", "--init-from-hf", str(int8), "--tokenizer",
                                                            str(tok), "--run-dir", "NEW"]),
        ("load-balancing weight for a model without experts", ["train", *RUN, "--router-aux-loss-coef", "0.01",
                                                               "--run-dir", "NEW"]),
        ("--distributed outside a cluster", ["train", *RUN, "--distributed", "--run-dir", "NEW"]),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "bad_inputs"),
                    help="results stem: writes STEM.md and STEM.csv")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = pathlib.Path(tmp)
        run = d / "run"
        p, _ = cli("train", *RUN, "--steps", "2", "--checkpoint-every", "1", "--run-dir", str(run))
        if p.returncode:
            sys.exit(f"the reference run failed:\n{p.stderr[-3000:]}")
        corrupt = d / "corrupt"
        subprocess.run(["cp", "-r", str(run), str(corrupt)], check=True)
        for f in (corrupt / "checkpoints" / "2").rglob("*"):  # truncate every array file of the latest checkpoint
            if f.is_file() and f.stat().st_size > 1024:
                f.write_bytes(f.read_bytes()[:100])
        nockpt = d / "nockpt"  # as if killed before its first checkpoint
        subprocess.run(["cp", "-r", str(run), str(nockpt)], check=True)
        subprocess.run(["rm", "-r", str(nockpt / "checkpoints")], check=True)
        hf, hfrun = d / "hf", d / "hfrun"
        p, _ = cli("export", "--run-dir", str(run), "--out", str(hf))
        if p.returncode:
            sys.exit(f"the export failed:\n{p.stderr[-3000:]}")
        word_tokenizer(hf)  # the tiny run reads UTF-8 bytes: the folder gets a tokenizer.json of its own
        p, _ = cli("train", "--init-from-hf", str(hf), *RUN[2:], "--steps", "1", "--run-dir", str(hfrun))
        if p.returncode:
            sys.exit(f"the --init-from-hf run failed:\n{p.stderr[-3000:]}")
        (hf / "config.json").write_text(json.dumps({**json.loads((hf / "config.json").read_text()),
                                                    "rms_norm_eps": 1e-5}))  # edited after the run started (tiny: 1e-6)
        named = {"CORRUPT": corrupt, "NOCKPT": nockpt, "HFRUN": hfrun}
        rows = []
        for what, argv in cases(d, run):
            new = d / f"new-{len(rows)}"
            watched = next((named[a] for a in argv if a in named), run)
            argv = [str(new) if a == "NEW" else str(named[a]) if a in named else a for a in argv]
            before = snapshot(watched)
            p, secs = cli(*argv)
            err = [line for line in p.stderr.splitlines() if line.strip()]
            errors = [line for line in err if line.startswith("error:")]
            ok = (p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stderr and not new.exists()
                  and snapshot(watched) == before)
            rows.append({"case": what, "exit": p.returncode, "one line": len(errors) == 1,
                         "traceback": "Traceback" in p.stderr, "wrote": new.exists() or snapshot(watched) != before,
                         "ok": ok, "message": (errors or err or ["(none)"])[-1].replace(str(d), "$TMPDIR")
                         .replace(STDLIB, "$STDLIB")[:200].replace("|", "/"),
                         "s": round(secs, 1)})
            print(json.dumps(rows[-1]), flush=True)
    os.environ["JAX_PLATFORMS"] = "cpu"
    meta = run_header(result=f"{sum(r['ok'] for r in rows)} of {len(rows)} cases give exit 2, one `error:` line, "
                             "no traceback, and write nothing")
    paths = write_table(args.out, "Bad inputs to the ulysses-jax entry point (8 fake CPU devices)", meta,
                        list(rows[0]), rows)
    print("wrote", *paths)
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
