"""The passkey samples as an lm-evaluation-harness task folder, to score an exported model outside ulysses-jax.

``write_lm_eval_task(folder, samples, decode)`` writes ``ulysses_passkey.jsonl`` (one ``{"input", "answer", "length",
"depth"}`` object per sample: the text up to the answer, and the key) and ``ulysses_passkey.yaml``, a task that
lm-evaluation-harness reads with ``--include_path <folder> --tasks ulysses_passkey``: a local JSON dataset, greedy
generation until ``"."``, exact match against the key. The harness then runs the exported Hugging Face folder
(``ulysses-jax export``) without sequence parallelism: see docs/long_context_eval.md for what fits where.
"""

from __future__ import annotations

import json
import pathlib

TASK = "ulysses_passkey"


def write_lm_eval_task(folder, samples, decode) -> pathlib.Path:
    """``samples``: ``(passkey.Sample, length, depth)`` triples; ``decode``: token ids -> text. Returns the YAML."""
    folder = pathlib.Path(folder).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{TASK}.jsonl"
    with data.open("w") as f:
        for s, length, depth in samples:
            prompt = decode(s.tokens[: s.answer[0]])
            f.write(json.dumps({"input": prompt, "answer": s.key, "length": int(length), "depth": float(depth)}) + "\n")
    yaml = folder / f"{TASK}.yaml"
    yaml.write_text(
        f"# written by `ulysses-jax eval --task passkey --harness-task {folder.name}`\n"
        f"task: {TASK}\n"
        f"dataset_path: json\n"
        f"dataset_kwargs:\n"
        f"  data_files:\n"
        f"    test: {json.dumps(str(data))}\n"
        f"test_split: test\n"
        f"output_type: generate_until\n"
        f'doc_to_text: "{{{{input}}}}"\n'
        f'doc_to_target: "{{{{answer}}}}"\n'
        f"generation_kwargs:\n"
        f"  until: [\".\", \"\\n\"]\n"
        f"  do_sample: false\n"
        f"  max_gen_toks: 16\n"
        f"filter_list:\n"
        f"  - name: strip\n"
        f"    filter:\n"
        f"      - function: regex\n"
        f"        regex_pattern: \"(\\\\d+)\"\n"
        f"      - function: take_first\n"
        f"metric_list:\n"
        f"  - metric: exact_match\n"
        f"    aggregation: mean\n"
        f"    higher_is_better: true\n"
        f"metadata:\n"
        f"  version: 1.0\n"
    )
    return yaml
