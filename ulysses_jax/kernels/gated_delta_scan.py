"""The gated delta rule's scan over chunks as two Pallas kernels: forward and backward, state kept on chip.

:mod:`ulysses_jax.kernels.gated_delta` computes each block's intra-chunk parts with batched XLA matmuls and then
walks the block's ``M`` chunks one after another, carrying the ``[dk, dv]`` state. As a ``lax.scan`` that walk is
``M`` iterations of a few small products each: per chunk and value head ``u_c = U - W S``, ``o = Qg S + A u_c``,
``S' = gam_last S + Kd^T u_c`` (the names of :func:`gated_delta._intra`). Here the same walk is one kernel launch per
block: each program owns one value head and ``block_v`` of its ``dv`` columns (the columns are independent: every
product above keeps them apart), keeps its slice of the state in registers across the ``M`` chunks, and reads each
chunk's parts once. The backward is one more launch walking the chunks in reverse with ``dL/dS`` on chip.

Per chunk, with ``dS'`` the gradient of the outgoing state and ``do`` the output's (the step's own vjp)::

    du_c = A^T do + Kd dS'          dS = gam_last dS' + Qg^T do - W^T du_c         dU = du_c
    dW = -du_c S^T    dA = do u_c^T    dQg = do S^T    dKd = u_c dS'^T    dgam_last = sum(S * dS')

The recurrence (the first line) needs neither the states ``S`` nor ``u``: the kernel walks it and writes ``du_c``
and each chunk's ``dS'``; the second line, which sums over the value columns, is then XLA's, batched over all the
chunks of the block at once from those and each chunk's incoming state ``S`` (the forward writes them when asked,
``keep_states``: what the XLA backward's own scan makes).

Precision: ``low=False`` computes every product on float32 operands, as Triton's ``tf32x3`` on a GPU (three TF32
tensor-core products, about float32's accuracy, where the XLA walk's ``HIGHEST`` products are IEEE float32) and at
``HIGHEST`` in interpret mode;
``low=True`` rounds both operands to bfloat16 (float32 accumulators), as :func:`gated_delta._dot` does. The state
is float32 throughout (float64 for float64 inputs, interpret mode only).

On a GPU the calls lower through Triton (compiler params passed explicitly, as ``flash_attention`` does); elsewhere
they run in Pallas' interpret mode. Layouts (``H`` = batch x value heads, flattened; ``C`` the chunk, ``M`` the
chunks of a block): ``state [H, dk, dv]``; ``u [M, H, C, dv]``; ``w, qg, kd [M, H, C, dk]``; ``a [M, H, C, C]``;
``gam_last [M, H]``; ``o`` like ``u``; kept states ``[M, H, dk, dv]``. Not yet run on a GPU: the ptxas figures of
the compile-only H100 build are in ``tests/test_gated_delta_scan.py``'s GPU-compile case. The reference the kernels
are tested against is the ``lax.scan`` of :func:`gated_delta._step` (and its autodiff vjp), which takes these layouts
as they are.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# ---------------------------------------------------------------------------------------------------
# Block sizes
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ScanBlocks:
    """``block_v``: value columns per program (a power of two >= 16 dividing ``dv``; None: 32 where it divides ``dv``,
    else 16); warps and pipeline stages of the Triton launch (forward, backward; stages None: 2 with bfloat16
    products, 1 with float32 ones).

    The defaults, from ptxas on the compile-only H100 (``dk = dv = 128``, ``C = 64``; ``tests/test_gated_delta_scan.py``
    holds them): with bfloat16 products no register spills at 32 or 64 columns (4 warps, 2 stages); float32 products
    (tf32x3: each operand split in two, three products) spill 432-444 B (the forward walks) and 692 B (backward) per
    thread at 32 columns and 1 stage, more with 2 stages (680 / 1,340 B) or 8 warps (``experiments/delta_launches.py``
    prints them). 32 columns also give ``dv / 32`` programs per head, the only parallelism a sequential walk has
    besides the heads."""

    block_v: int | None = None
    num_warps: tuple[int, int] = (4, 4)
    num_stages: tuple[int, int] | None = None

    def launch(self, kernel: int, low: bool) -> tuple[int, int]:
        """``(num_warps, num_stages)`` of ``kernel`` (0 forward, 1 backward)."""
        stages = self.num_stages[kernel] if self.num_stages is not None else (2 if low else 1)
        return self.num_warps[kernel], stages

    def columns(self, dv: int) -> int:
        bv = self.block_v if self.block_v is not None else (32 if dv % 32 == 0 else 16)
        if bv < 16 or bv & (bv - 1) or dv % bv:
            raise ValueError(f"block_v {bv} must be a power of two >= 16 dividing dv = {dv}")
        return bv


def check_shapes(c: int, dk: int, dv: int) -> None:
    """The tiles a Triton product takes: ``C`` and ``dk`` powers of two >= 16, ``dv`` a multiple of 16 (float64 runs
    only in interpret mode: the caller's check)."""
    for name, x in (("chunk", c), ("dk", dk)):
        if x < 16 or x & (x - 1):
            raise ValueError(f"the Pallas delta-rule scan needs {name} a power of two >= 16, got {x}; use impl='xla'")
    if dv % 16:
        raise ValueError(f"the Pallas delta-rule scan needs dv a multiple of 16, got {dv}; use impl='xla'")


# ---------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------


def _dot(a, b, *, low: bool, gpu: bool, trans_a: bool = False, trans_b: bool = False):
    """2-D product with a float32 (float64) result; operands rounded to bfloat16 when ``low``; on a GPU float32
    operands as tf32x3, in interpret mode at HIGHEST."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    out = jnp.promote_types(jnp.promote_types(a.dtype, b.dtype), jnp.float32)
    if low:
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        precision = None
    elif gpu:
        precision = lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    else:
        precision = lax.Precision.HIGHEST
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=out)


def _fwd_kernel(s0_ref, u_ref, w_ref, a_ref, qg_ref, kd_ref, gl_ref, o_ref, s1_ref, hs_ref, *, m: int, low: bool,
                gpu: bool):
    # s0_ref [dk, Bv] | u_ref [M, C, Bv] | w_ref, qg_ref, kd_ref [M, C, dk] | a_ref [M, C, C] | gl_ref [M]
    # o_ref [M, C, Bv] or None (only the states wanted) | s1_ref [dk, Bv] | hs_ref [M, dk, Bv] or None
    dot = functools.partial(_dot, low=low, gpu=gpu)

    def body(i, s):
        if hs_ref is not None:
            hs_ref[i] = s
        uc = u_ref[i].astype(s.dtype) - dot(w_ref[i], s)
        if o_ref is not None:
            o_ref[i] = (dot(qg_ref[i], s) + dot(a_ref[i], uc)).astype(o_ref.dtype)
        return gl_ref[i] * s + dot(kd_ref[i], uc, trans_a=True)

    s1_ref[...] = lax.fori_loop(0, m, body, s0_ref[...])


def _bwd_kernel(w_ref, a_ref, qg_ref, kd_ref, gl_ref, do_ref, ds1_ref, ds0_ref, du_ref, dhs_ref, *, m: int,
                low: bool, gpu: bool):
    # w_ref, qg_ref, kd_ref [M, C, dk] | a_ref [M, C, C] | gl_ref [M] | do_ref [M, C, Bv] | ds1_ref [dk, Bv]
    # ds0_ref [dk, Bv] | du_ref [M, C, Bv] | dhs_ref [M, dk, Bv]: the gradient of the state leaving each chunk
    dot = functools.partial(_dot, low=low, gpu=gpu)

    def body(r, ds):
        i = m - 1 - r
        dhs_ref[i] = ds
        do = do_ref[i].astype(ds.dtype)
        duc = dot(a_ref[i], do, trans_a=True) + dot(kd_ref[i], ds)
        du_ref[i] = duc
        return gl_ref[i] * ds + dot(qg_ref[i], do, trans_a=True) - dot(w_ref[i], duc, trans_a=True)

    ds0_ref[...] = lax.fori_loop(0, m, body, ds1_ref[...])


# ---------------------------------------------------------------------------------------------------
# Wrappers (the custom_vjp is gated_delta._chunked's: these are its forward's and backward's scans)
# ---------------------------------------------------------------------------------------------------


def _params(blocks: ScanBlocks, kernel: int, low: bool, interpret: bool):
    """Triton compiler params on a GPU (always passed: without them jax >= 0.10 lowers to Mosaic GPU), None in
    interpret mode."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    num_warps, num_stages = blocks.launch(kernel, low)
    params_cls = getattr(pltriton, "CompilerParams", None) or getattr(pl, "TritonCompilerParams")
    return params_cls(num_warps=num_warps, num_stages=num_stages)


def _specs(m, c, dk, bv):
    """BlockSpecs over the grid ``(H, dv / Bv)``: column-blocked ``[M, C, Bv]``, whole ``[M, C, dk]``, ``[M, C,
    C]``, ``[M]``, a state ``[dk, Bv]`` and kept states ``[M, dk, Bv]``."""
    return dict(
        cols=pl.BlockSpec((m, None, c, bv), lambda h, j: (0, h, 0, j)),
        keys=pl.BlockSpec((m, None, c, dk), lambda h, j: (0, h, 0, 0)),
        square=pl.BlockSpec((m, None, c, c), lambda h, j: (0, h, 0, 0)),
        scalar=pl.BlockSpec((m, None), lambda h, j: (0, h)),
        state=pl.BlockSpec((None, dk, bv), lambda h, j: (h, 0, j)),
        states=pl.BlockSpec((m, None, dk, bv), lambda h, j: (0, h, 0, j)),
    )


def scan_forward(state, parts, *, low: bool = False, keep_states: bool = False, output: bool = True,
                 blocks: ScanBlocks = ScanBlocks(), interpret: bool = True):
    """``(state after the block [H, dk, dv], o [M, H, C, dv] in u's dtype or None, each chunk's incoming state [M, H,
    dk, dv] or None)`` from ``state [H, dk, dv]`` and ``parts = (u, w, a, qg, kd, gam_last)`` (module docstring).
    ``output=False`` skips ``o`` (the backward wants only the states)."""
    u, w, a, qg, kd, gl = parts
    (m, h, c, dv), dk = u.shape, w.shape[-1]
    check_shapes(c, dk, dv)
    bv = blocks.columns(dv)
    sp = _specs(m, c, dk, bv)
    f = state.dtype
    wanted = [(output, jax.ShapeDtypeStruct(u.shape, u.dtype), sp["cols"]),
              (True, jax.ShapeDtypeStruct(state.shape, f), sp["state"]),
              (keep_states, jax.ShapeDtypeStruct((m, h, dk, dv), f), sp["states"])]
    outs = iter(pl.pallas_call(
        functools.partial(_some_outputs, functools.partial(_fwd_kernel, m=m, low=low, gpu=not interpret),
                          tuple(w_ for w_, _, _ in wanted)),
        grid=(h, dv // bv),
        in_specs=[sp["state"], sp["cols"], sp["keys"], sp["square"], sp["keys"], sp["keys"], sp["scalar"]],
        out_specs=[spec for w_, _, spec in wanted if w_],
        out_shape=[shape for w_, shape, _ in wanted if w_],
        compiler_params=_params(blocks, 0, low, interpret),
        interpret=interpret,
        name="gated_delta_scan_fwd" if output else "gated_delta_scan_states",
    )(state, u, *_operands(parts, f, low), gl.astype(f)))
    o, s1, hs = (next(outs) if w_ else None for w_, _, _ in wanted)
    return s1, o, hs


def _operands(parts, f, low: bool):
    """``w, a, qg, kd``: the parts that are only ever product operands, in bfloat16 when ``low`` (the products round
    them to it anyway: half the bytes read and the registers held), else in the compute dtype."""
    return tuple(x.astype(jnp.bfloat16 if low else f) for x in parts[1:5])


def _some_outputs(kernel, wanted: tuple[bool, ...], *refs):
    """``kernel`` with None for each output ref not ``wanted`` (the pallas_call has only the wanted ones)."""
    ins, outs = refs[: len(refs) - sum(wanted)], iter(refs[len(refs) - sum(wanted):])
    return kernel(*ins, *(next(outs) if w else None for w in wanted))


def scan_backward(chunk_states, parts, do, d_state, *, low: bool = False, blocks: ScanBlocks = ScanBlocks(),
                  interpret: bool = True):
    """The reverse walk: ``(dL/d incoming state [H, dk, dv], (du, dw, da, dqg, dkd, dgam_last))`` shaped as the
    parts, from each chunk's incoming state ``[M, H, dk, dv]``, the parts, ``do [M, H, C, dv]`` and the gradient of
    the state leaving the block ``d_state [H, dk, dv]``.

    Only the recurrence is the kernel's: ``dS`` and ``du_c`` need neither the states nor ``u``. It writes the
    gradient of the state leaving each chunk, and the products that sum over the value columns (``dW, dA, dQg, dKd,
    dgam_last``) are then batched over all chunks at once by XLA, as large products (no partial sums per column
    block, and far fewer registers in the kernel: with them inside it spilled on the compile-only H100)."""
    u, w, a, qg, kd, gl = parts
    (m, h, c, dv), dk = u.shape, w.shape[-1]
    check_shapes(c, dk, dv)
    bv = blocks.columns(dv)
    f = d_state.dtype
    sp = _specs(m, c, dk, bv)
    ds0, du, dhs = pl.pallas_call(
        functools.partial(_bwd_kernel, m=m, low=low, gpu=not interpret),
        grid=(h, dv // bv),
        in_specs=[sp["keys"], sp["square"], sp["keys"], sp["keys"], sp["scalar"], sp["cols"], sp["state"]],
        out_specs=[sp["state"], sp["cols"], sp["states"]],
        out_shape=[jax.ShapeDtypeStruct(d_state.shape, f), jax.ShapeDtypeStruct(u.shape, f),
                   jax.ShapeDtypeStruct(chunk_states.shape, f)],
        compiler_params=_params(blocks, 1, low, interpret),
        interpret=interpret,
        name="gated_delta_scan_bwd",
    )(*_operands(parts, f, low), gl.astype(f), do, d_state)
    dot = functools.partial(chunk_product, low=low)
    do = do.astype(f)
    uc = u.astype(f) - dot("mhck,mhkv->mhcv", w, chunk_states)
    grads = (du, -dot("mhcv,mhkv->mhck", du, chunk_states), dot("mhiv,mhjv->mhij", do, uc),
             dot("mhcv,mhkv->mhck", do, chunk_states), dot("mhcv,mhkv->mhck", uc, dhs),
             jnp.sum(chunk_states * dhs, axis=(-2, -1)))
    return ds0, tuple(g.astype(p.dtype) for g, p in zip(grads, parts))


def chunk_product(spec: str, a, b, low: bool):
    """An XLA chunk product (``einsum`` by ``spec``): float32 at HIGHEST precision, or (``low``) bfloat16 operands
    with a float32 result, as flash-linear-attention's kernels take them; float64 inputs stay float64 at HIGHEST.
    ``gated_delta``'s products and this backward's share it."""
    if low and a.dtype != jnp.float64:
        return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    return jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST)
