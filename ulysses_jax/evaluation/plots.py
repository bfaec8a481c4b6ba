"""The two pictures of ``ulysses-jax eval``: loss by position (log x-axis) and the passkey heat map.

matplotlib is imported inside each function (with the Agg backend: no display needed), so importing the package
stays light; it is a runtime dependency because ``eval`` draws both by default (``--no-plot`` skips them).
"""

from __future__ import annotations

import pathlib


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_by_position(by_step: list[dict], path, *, title: str) -> pathlib.Path:
    """One line per evaluated step: mean loss of each position bucket at the bucket's geometric middle."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    ends = sorted({b["end"] for res in by_step for b in res["buckets"]})
    for res in by_step:  # bucket [a, b): predictions from a + 1 .. b tokens of context, drawn at b
        points = [(b["end"], b["loss"]) for b in res["buckets"] if b["loss"] is not None]
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", ms=4,
                label=f"step {res['step']} (loss {res['loss']:.3f})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ends, [f"{n // 1024}K" if n >= 4096 and n % 1024 == 0 else str(n) for n in ends])
    ax.minorticks_off()
    ax.set_xlabel("tokens of context: position in the document, bucket's upper end (log scale)")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_passkey(results: list[dict], path, *, title: str) -> pathlib.Path:
    """Accuracy by depth (rows) and length (columns), red (0) to green (1), each cell labelled."""
    plt = _pyplot()
    lengths = sorted({r["length"] for r in results})
    depths = sorted({r["depth"] for r in results})
    grid = [[None] * len(lengths) for _ in depths]
    for r in results:
        grid[depths.index(r["depth"])][lengths.index(r["length"])] = r["accuracy"]
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.6, 0.5 * len(depths) + 1.9), dpi=100)
    values = [[float("nan") if v is None else v for v in row] for row in grid]
    im = ax.imshow(values, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v is not None:
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("sample length (tokens)")
    ax.set_ylabel("needle depth (0 = start)")
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label="accuracy")
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
