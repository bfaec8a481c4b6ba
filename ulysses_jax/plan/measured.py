"""Training steps this project has timed on a GPU, for ``plan`` to print the nearest one beside its estimate.

Each row is a committed result (``experiments/results/``; the file named in ``source``): one GPU, batch 1,
``experiments/bench_train.py``'s step with the flags given, rows of ``documents`` random documents. An estimate is only
as good as its distance from these: ``nearest`` picks the row of the same GPU kind and model that is closest in
length (then in flags), and ``plan`` prints it with the estimate. New GPU sessions add their rows here.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Measured:
    gpu: str  # "h100" or "h200" (plan's targets)
    preset: str
    mode: str  # "full" or "lora16"
    seq_len: int
    documents: int  # per row
    flags: str  # bench_train's (train's names), beyond --preset and --seq-lens
    step_s: float
    source: str  # the committed result it comes from

    def describe(self) -> str:
        return (f"{self.preset} {self.mode} at {self.seq_len:,} tokens ({self.documents} document"
                f"{'s' if self.documents > 1 else ''} a row) on one {self.gpu.upper()}, {self.flags}: "
                f"{self.step_s:.3f} s measured ({self.source})")


_CUDNN = "--attention cudnn --remat full --loss-chunk 4096 --mlp-chunk 4096"
_AUTO = "--attention auto --remat full --loss-chunk 4096 --mlp-chunk 4096"
_H100 = "experiments/results/gpu_h100_20261126"
_H200 = "experiments/results/gpu_h200_20261126"
_PEERS = "experiments/results/peers_h100_20261127.csv"
_KEEP = _AUTO + " --attn-keep"
_SAVE = "--attention auto --remat save_matmuls --attn-keep --loss-chunk 4096 --mlp-chunk 0"
_PEERS_H200 = "experiments/results/peers_h200_20261128.csv"
_PEERS_H200B = "experiments/results/peers_h200_20261128b.csv"
_MLP_KEEP = "--attention auto --remat full --attn-keep --mlp-keep --loss-chunk 4096 --mlp-chunk 0"
_ONE = " --attn-max-documents 1"


def _beside_peers(gpu: str, source: str, rows, suffix: str = "") -> tuple[Measured, ...]:
    """Rows of one document each, timed beside the peers in one call (``experiments/bench_peers.py``): ``rows`` of
    (preset, mode, seq_len, flags, step_s), ``suffix`` added to every row's flags."""
    return tuple(Measured(gpu, preset, mode, seq, 1, flags + suffix, step, source)
                 for preset, mode, seq, flags, step in rows)


ROWS: tuple[Measured, ...] = (
    Measured("h100", "llama3.2-1b", "full", 8192, 4, _CUDNN, 0.210, f"{_H100}/train_cudnn_packed_20261126-140630.md"),
    Measured("h100", "llama3.2-1b", "full", 32768, 4, _CUDNN, 1.080, f"{_H100}/train_cudnn_packed_20261126-140630.md"),
    Measured("h100", "llama3.2-1b", "full", 32768, 4, "--attention pallas --remat full --loss-chunk 4096 "
             "--mlp-chunk 4096", 1.902, f"{_H100}/train_pallas_20261126-140709.md"),
    Measured("h100", "llama3.2-1b", "full", 32768, 4, _KEEP, 0.996,
             f"{_H100}b/train_bench_keep.log"),
    Measured("h200", "llama3.2-1b", "full", 8192, 4, _AUTO, 0.196, f"{_H200}/b1_full.log"),
    Measured("h200", "llama3.2-1b", "full", 32768, 4, _AUTO, 1.038, f"{_H200}/b1_full.log"),
    Measured("h200", "llama3.2-1b", "lora16", 8192, 4, _AUTO, 0.158, f"{_H200}/b1_lora_new.log"),
    Measured("h200", "llama3.2-1b", "lora16", 32768, 4, _AUTO, 0.910, f"{_H200}/b1_lora_new.log"),
    Measured("h200", "llama3.1-8b", "lora16", 32768, 4, _AUTO, 3.785, f"{_H200}/b8_lora_new.log"),
    # one document a row, beside the peers in the same call (experiments/bench_peers.py); plan's calibration
    *_beside_peers("h100", _PEERS, (
        ("llama3.2-1b", "full", 32768, _AUTO, 1.478),
        ("llama3.2-1b", "full", 32768, _KEEP, 1.312),
        ("llama3.2-1b", "full", 32768, _SAVE, 1.207),
        ("llama3.2-1b", "full", 32768, _KEEP + " --fp8", 1.309),
        ("llama3.2-1b", "full", 131072, _KEEP, 12.375),
        ("llama3.1-8b", "lora16", 8192, _KEEP, 0.833),
        ("llama3.1-8b", "lora16", 8192, _KEEP + " --fp8", 0.766),
        ("llama3.1-8b", "lora16", 32768, _KEEP, 4.606))),
    # the same on an H200 (2026-11-28), after the tiled loss's float32 GEMMs were removed (layers.wide_dot)
    *_beside_peers("h200", _PEERS_H200, (
        ("llama3.2-1b", "full", 32768, _SAVE, 1.106),
        ("llama3.2-1b", "full", 32768, _SAVE + " --attn-max-documents 1", 1.096),
        ("llama3.1-8b", "lora16", 8192, _KEEP, 0.787),
        ("llama3.1-8b", "lora16", 8192, _KEEP + " --fp8", 0.663),
        ("llama3.1-8b", "lora16", 8192, _KEEP + " --fp8 --attn-max-documents 1", 0.630))),
    # the evening's (2026-11-28, commit 274568a): the fused loss, float8 GEMMs writing bf16, cuDNN's causal mask alone
    # for one document a row; plan's calibration since (estimate.CALIBRATED_ON)
    *_beside_peers("h200", _PEERS_H200B, (
        ("llama3.2-1b", "full", 32768, _SAVE, 1.040),
        ("llama3.2-1b", "full", 32768, _SAVE + " --fp8", 0.964),
        ("llama3.2-1b", "full", 32768, _SAVE + " --scan-unroll", 1.019),
        ("llama3.1-8b", "lora16", 32768, _MLP_KEEP, 3.919),
        ("llama3.1-8b", "lora16", 32768, _MLP_KEEP + " --fp8", 3.308),
        ("llama3.1-8b", "lora16", 32768, _KEEP, 4.355),
        ("llama3.1-8b", "lora16", 8192, _SAVE, 0.638),
        ("llama3.1-8b", "lora16", 8192, _SAVE + " --fp8", 0.500),
        ("llama3.1-8b", "lora16", 8192, _KEEP, 0.776)), _ONE),
)


def nearest(gpu: str, preset: str, seq_len: int, *, lora: bool = False, flags: str = "") -> Measured | None:
    """The measured row closest to a plan: the same GPU kind and model (None if there is none), then the same mode,
    then the nearest length (by ratio), then the most flags in common, the fewest others, the newest."""
    mode = "lora16" if lora else "full"
    rows = [r for r in ROWS if r.gpu == gpu and r.preset == preset]
    if not rows:
        return None
    given = set(flags.split())

    def distance(i_row):  # a tie goes to the later row (-i): the newer program's
        i, r = i_row
        have = set(r.flags.split())
        return (r.mode != mode, abs(math.log(r.seq_len / seq_len)), -len(given & have), len(have - given), -i)

    return min(enumerate(rows), key=distance)[1]
