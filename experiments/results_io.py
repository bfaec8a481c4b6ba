"""What every benchmark result file carries (date, hardware, jax, command, commit), and the writer of its
markdown table and CSV. Imported by the scripts beside it (``python experiments/<script>.py``)."""

from __future__ import annotations

import csv
import datetime
import os
import pathlib
import shlex
import subprocess
import sys


def git_head() -> str:
    """The checkout's commit; ``ULYSSES_JAX_COMMIT`` where the tree travelled without its git folder (a lent GPU)."""
    if os.environ.get("ULYSSES_JAX_COMMIT"):
        return os.environ["ULYSSES_JAX_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10,
                              cwd=pathlib.Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_header(**extra: str) -> dict[str, str]:
    """Date, hardware, jax version, command line and commit, then ``extra``."""
    import jax

    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "hardware": f"{dev.device_kind} ({dev.platform}) x{jax.device_count()}",
        "jax": jax.__version__,
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "commit": git_head(),
        **extra,
    }


def write_table(stem: str | pathlib.Path, title: str, meta: dict, cols: list[str], rows: list[dict]) -> list[str]:
    """``stem.csv`` (meta as ``#`` lines) and ``stem.md`` (meta as a list, then the table); returns the paths."""
    stem = pathlib.Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{stem}.csv", "w", newline="") as f:
        f.writelines(f"# {k}: {v}\n" for k, v in meta.items())
        writer = csv.DictWriter(f, fieldnames=cols, restval="")
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"# {title}", ""] + [f"- {k}: `{v}`" for k, v in meta.items()] + ["", ""]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    pathlib.Path(f"{stem}.md").write_text("\n".join(lines) + "\n")
    return [f"{stem}.csv", f"{stem}.md"]
