"""gpt-oss's MXFP4 expert weights, as the Hub stores them, back to floating point on import.

MXFP4 (the OCP microscaling format, as the gpt-oss checkpoints lay it out): ``{name}_blocks`` (uint8 ``[E, R, G, 16]``)
packs two 4-bit E2M1 values per byte, the low nibble first; ``{name}_scales`` (uint8 ``[E, R, G]``) holds one power of
two per block of 32 values, biased by 127. A block's values are ``E2M1[nibble] * 2 ** (scale - 127)``. The ``R`` rows
are the projection's outputs and the ``G * 32`` values of a row its inputs, so the float tensor is the transpose,
``[E, G * 32, R]``: the ``[experts, in, out]`` layout of transformers' ``GptOssExperts`` (``gate_up_proj``:
``[E, hidden, 2 * width]``, ``down_proj``: ``[E, width, hidden]``). ``tests/test_gpt_oss.py`` checks ``dequantize``
against transformers' own conversion on random blocks.
"""

from __future__ import annotations

import numpy as np

# the 16 values of a 4-bit E2M1 number: sign bit, 2 exponent bits, 1 mantissa bit
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
SUFFIXES = ("_blocks", "_scales")


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``[E, G * 32, R]`` of ``blocks [E, R, G, 16]`` (uint8) and ``scales [E, R, G]`` (uint8)."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.ndim != 4:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match ([E, R, G, 16] and "
                         f"[E, R, G]); the checkpoint is damaged: copy it again from its source")
    values = np.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), np.float32)
    values[..., 0::2] = E2M1[blocks & 0x0F]
    values[..., 1::2] = E2M1[blocks >> 4]
    values = np.ldexp(values, (scales.astype(np.int32) - 127)[..., None])
    e, r, g, n = values.shape
    return values.reshape(e, r, g * n).transpose(0, 2, 1)


def check_shapes(tensors: dict, name: str, shape: tuple[int, ...]) -> None:
    """``name`` stored as MXFP4 blocks and scales (``tensors``: name -> ``(file, shape, dtype)`` from the safetensors
    headers) whose dequantised shape is ``shape`` (``[E, in, out]``); else ``ValueError`` naming the tensor."""
    e, n_in, n_out = shape
    want = {"_blocks": (e, n_out, n_in // 32, 16), "_scales": (e, n_out, n_in // 32)}
    for suffix, dims in want.items():
        file, have, dtype = tensors[name + suffix]
        if tuple(have) != dims or dtype != "U8" or n_in % 32:
            raise ValueError(f"tensor {name + suffix} in {file} is {dtype} {list(have)}, but MXFP4 weights of "
                             f"{list(shape)} are U8 {list(dims)}; the weights do not match config.json")
