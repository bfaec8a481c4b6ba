"""ptxas figures and instruction mix of the Pallas FlashAttention kernels compiled for an H100, before and after.

No GPU needed: with the CUDA plugin (the ``aot`` extra) XLA compiles the kernels for a compile-only H100
("deviceless" AOT), runs ptxas itself (``-arch=sm_90a --warn-on-spills``), and ``ulysses_jax.plan.kernel_report``
reads the launches (grid, threads, dynamic shared memory) from XLA's thunk sequence, registers / spills from
``ptxas -v`` on the dumped PTX, and the instruction mix from the PTX: Hopper ``wgmma.mma_async``, Ampere-style
``mma.sync``, TMA (``cp.async.bulk``) and Ampere async copies (``cp.async``); resident blocks per SM follow from
registers and shared memory. Beside them, the static estimate of each kernel's rate (``kernels/flash_estimate.py``,
an estimate, not a measurement) at S=16K. "before" is the kernel and block-size files at ``--before-rev`` (read with
``git show``), "after" the working tree's. Shapes: B=1, S=4096, 8 heads (MHA), forward + backward (``jax.grad`` of a
sum). Also records the kernels' pointer-offset width at the lengths we advertise (64-bit proof). Writes
``experiments/results/kernel_ptxas_h100.md``.

    python experiments/kernel_ptxas.py [--before-rev 3078163] [--out-dir experiments/results] [--quick]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # the CUDA plugin registers without a GPU

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from results_io import run_header, write_table  # noqa: E402  (beside this script)

ROOT = pathlib.Path(__file__).parents[1]
KERNEL_FILE = "ulysses_jax/kernels/flash_attention.py"
BLOCKS_FILE = "ulysses_jax/kernels/flash_blocks.py"  # split from KERNEL_FILE later; absent at older revisions
COLS = ["version", "dtype", "head_dim", "segments", "causal", "kernel", "block_q x block_k", "warps", "stages",
        "shared_memory_bytes", "registers", "spill_store_bytes", "spill_load_bytes", "wgmma", "mma.sync", "TMA",
        "cp.async", "wgmma shapes", "blocks/SM", "estimate best / no overlap", "note"]


def _git_show(rev: str, path: str) -> str | None:
    out = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True, check=False)
    return out.stdout if out.returncode == 0 else None


def _exec_module(name: str, source: str):
    path = pathlib.Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def load_kernel_module(rev: str | None):
    """The kernel module of git revision ``rev`` (None: the working tree's), with that revision's block sizes."""
    if rev is None:
        import ulysses_jax.kernels.flash_attention as mod

        return mod
    source = _git_show(rev, KERNEL_FILE)
    blocks = _git_show(rev, BLOCKS_FILE)
    if blocks is not None:
        _exec_module(f"flash_blocks_{rev}", blocks)
        source = source.replace("ulysses_jax.kernels.flash_blocks", f"flash_blocks_{rev}")
    return _exec_module(f"flash_attention_{rev}", source)


def estimate_cell(version, dtype, head_dim, segments, causal, blocks, kernel) -> str:
    """The static estimate's (best, no overlap) fraction of the tensor-core peak at S=16K; "before" with the dK/dV
    kernel's queries-first products."""
    from ulysses_jax.kernels.flash_estimate import kernel_fractions

    try:
        est = kernel_fractions(head_dim, dtype, causal=causal, segment_ids=segments, seq_len=16_384,
                               block_sizes=blocks, dkv_keys_first=version == "after")[kernel]
    except ValueError:
        return ""
    return f"{est.best:.2f} / {est.no_overlap:.2f}"


def block_sizes(mod, head_dim, dtype):
    default = getattr(mod, "default_block_sizes", None)
    return default(head_dim, dtype) if default is not None else mod.BlockSizes()


def compile_kernels(mod, device, *, head_dim, dtype, segments, causal=True, seq_len=4096, heads=8, kv_heads=8,
                    dump_to=None):
    """Compile forward + backward for ``device``; returns ({kernel: KernelInfo}, {kernel: num_stages}) or an
    error line. ``dump_to``: keep XLA's dump (PTX included) there."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from ulysses_jax.plan.kernel_report import dump_options, kernels

    sharding = SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((1, seq_len, heads, head_dim), dtype, sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, seq_len, kv_heads, head_dim), dtype, sharding=sharding)
    seg = jax.ShapeDtypeStruct((1, seq_len), jnp.int32, sharding=sharding) if segments else None

    def loss(q, k, v, seg):
        out = mod.flash_attention(q, k, v, causal=causal, segment_ids=seg, interpret=False)
        return out.astype(jnp.float32).sum()

    with tempfile.TemporaryDirectory() as tmp, jax.default_device(device):
        dump = dump_to or tmp
        try:
            lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, kv, kv, seg).lower()
            lowered.compile(compiler_options=dump_options(dump))
        except Exception as e:  # noqa: BLE001  (recorded in the table: XLA's or our refusal)
            line = re.sub(r"\S*/([^/\s]+\.py)", r"\1", str(e).splitlines()[0])  # no machine paths in the table
            return f"{type(e).__name__}: {line[:160]}"
        found = {k.name.removeprefix("flash_attention_"): k for k in kernels(dump, prefix="flash_attention")}
    # num_stages travels in the Triton custom call's backend config (jaxlib 0.10.2 route)
    stages = {m.group(1): int(m.group(2)) for m in
              re.finditer(r'name = "flash_attention_(\w+)", num_stages = (\d+)', lowered.as_text())}
    return found, stages


def tiles(blocks, kernel):
    return {"fwd": (blocks.block_q, blocks.block_k), "dkv": (blocks.block_q_dkv, blocks.block_k_dkv),
            "dq": (blocks.block_q_dq, blocks.block_k_dq)}[kernel]


def offset_widths(device, *, seq_len, heads=8, head_dim=128):
    """{kernel: Counter of pointer-offset integer widths of its bfloat16 tt.addptr ops} in the Triton IR that
    Pallas hands to XLA, for bfloat16 q/k/v of [1, seq_len, heads, head_dim] with segment ids. Lowering only."""
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import lowering as triton_lowering
    from jax.sharding import SingleDeviceSharding

    from ulysses_jax.kernels.flash_attention import flash_attention

    modules = []
    original = triton_lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        modules.append(result.module.operation.get_asm())
        return result

    sharding = SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((1, seq_len, heads, head_dim), jnp.bfloat16, sharding=sharding)
    seg = jax.ShapeDtypeStruct((1, seq_len), jnp.int32, sharding=sharding)

    def loss(q, k, v, seg):
        return flash_attention(q, k, v, segment_ids=seg, interpret=False).astype(jnp.float32).sum()

    triton_lowering.lower_jaxpr_to_triton_module = capture
    try:
        with jax.default_device(device):
            jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x, seg).lower()
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = original
    return {re.search(r"@(flash_attention_\w+)", m).group(1): collections.Counter(
        re.findall(r"tt\.addptr .*!tt\.ptr<bf16>.*, tensor<[\dx]+x(i\d+)>", m)) for m in modules}


def ptx_widenings(device, *, seq_len, heads=8, head_dim=128):
    """{kernel: 32-bit element offsets of 2-byte elements (``mul.wide.s32 %rd, %r, 2``) added to a global
    pointer, i.e. to anything but the shared-memory base} in the PTX XLA compiled for bfloat16 q/k/v
    [1, seq_len, heads, head_dim] with segment ids."""
    import jax.numpy as jnp

    mod = load_kernel_module(None)
    with tempfile.TemporaryDirectory() as dump:
        compile_kernels(mod, device, head_dim=head_dim, dtype=jnp.bfloat16, segments=True, seq_len=seq_len,
                        heads=heads, kv_heads=heads, dump_to=dump)
        counts = {}
        for ptx in pathlib.Path(dump).glob("*.ptx"):
            text = ptx.read_text()
            smem = set(re.findall(r"mov\.b64\s+(%rd\d+), global_smem;", text))
            widened = re.findall(r"mul\.wide\.s32\s+(%rd\d+), %r\d+, 2;", text)
            to_global = 0
            for rd in widened:
                uses = re.findall(rf"add\.s64\s+%rd\d+, (%rd\d+), {rd};|add\.s64\s+%rd\d+, {rd}, (%rd\d+);", text)
                to_global += not uses or bool({a or b for a, b in uses} - smem)
            for name in re.findall(r"\.visible \.entry flash_attention_(\w+)\(", text):
                counts[name] = f"{to_global} of {len(widened)}"
    return counts


# (sequence lengths, segment ids, causal, query heads per KV head) that the "after" blocks are checked over
VARIANT_SEQ_LENS = {"bfloat16": (4096, 131072, 2**21), "float32": (4096, 131072)}


def variants(mod, device, dtype, head_dim):
    """Worst registers / spills / shared memory per kernel over the variants, and how many spilled."""
    import itertools

    import jax.numpy as jnp

    worst, n = {}, 0
    for s, seg, causal, group in itertools.product(VARIANT_SEQ_LENS[jnp.dtype(dtype).name], (False, True),
                                                   (True, False), (1, 4)):
        result = compile_kernels(mod, device, head_dim=head_dim, dtype=dtype, segments=seg, causal=causal,
                                 seq_len=s, kv_heads=8 // group)
        n += 1
        if isinstance(result, str):
            worst.setdefault("errors", []).append(f"S={s} seg={seg} causal={causal} G={group}: {result}")
            continue
        for name, k in result[0].items():
            w = worst.setdefault(name, dict(registers=0, spill=0, spilled=0, smem=0, mma_sync=0, wgmma=10**9, tma=0,
                                            blocks=10**9))
            spill = (k.spill_store_bytes or 0) + (k.spill_load_bytes or 0)
            w["registers"] = max(w["registers"], k.registers or 0)
            w["spill"], w["spilled"] = max(w["spill"], spill), w["spilled"] + (spill > 0)
            w["smem"] = max(w["smem"], k.shared_memory_bytes)
            w["mma_sync"], w["wgmma"] = max(w["mma_sync"], k.mma_sync or 0), min(w["wgmma"], k.wgmma or 0)
            w["tma"], w["blocks"] = max(w["tma"], k.tma or 0), min(w["blocks"], k.resident_blocks or 0)
    return worst, n


READING = """
## Reading the table

- **Instruction kinds.** Triton issues a product as Hopper `wgmma` when its M (the rows of the result) is a multiple
  of 64 and the block has whole warpgroups (warps a multiple of 4); otherwise as Ampere-style `mma.sync`. Before, the
  dK/dV kernel computed S = Q K^T and dP = dO V^T with the thin query block (32 rows) as M: those two of its four
  products were `mma.sync` (m16n8k16), the other two (dV, dK: the KV block as M) `wgmma`. After, it computes the
  transposes, S^T = K Q^T and dP^T = V dO^T, so all four products have the KV block (64 or 128 rows) as M: no
  `mma.sync` is left in any kernel. Instruction counts are static (in the PTX), not executed counts.
- **wgmma shapes.** `m64nNk16` per warpgroup; with 8 warps Triton splits M over the two warpgroups when M > 64,
  else N. A small N (n8, n16) is still wgmma but reads its operands from shared memory for little work: the
  estimate's operand bound (`ulysses_jax/kernels/flash_estimate.py`) charges it.
- **TMA: none, before or after.** Pallas' Triton lowering (jax 0.10.2, `jax/_src/pallas/triton/lowering.py`)
  addresses memory with tensors of pointers (`tt.addptr` + `tt.load`), never with tensor descriptors, and its
  compiler params are only `num_warps` / `num_stages`; Triton emits TMA (`cp.async.bulk.tensor`) only for
  descriptor loads. The copies are Ampere `cp.async`, software-pipelined over `num_stages` buffers.
- **blocks/SM**: resident thread blocks per SM from registers (65,536 per SM, allocated per warp in units of 256),
  shared memory (233,472 per SM, 1 KiB reserved per block) and threads (2,048).
- **estimate best / no overlap**: the static estimate at S=16K of the fraction of the dense bf16 tensor-core peak
  (989 TFLOP/s) the kernel's useful FLOPs can reach, with matmuls and softmax work overlapped, or not. An estimate
  from tiles, instruction kinds and loop bounds, not a measurement; its assumptions are in the module docstring.
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-rev", default="3078163", help="git revision of the 'before' kernel files")
    parser.add_argument("--out-dir", default=str(ROOT / "experiments" / "results"))
    parser.add_argument("--quick", action="store_true", help="bf16 head_dim 64 only, no variants (smoke run)")
    args = parser.parse_args(argv)

    import jax.numpy as jnp

    from ulysses_jax.plan.targets import target_devices

    device = target_devices("h100", devices=1)[0]
    versions = {"before": load_kernel_module(args.before_rev), "after": load_kernel_module(None)}
    cases = [(jnp.bfloat16, 64, False, True)] if args.quick else [
        (jnp.bfloat16, d, seg, True) for d in (64, 128) for seg in (False, True)
    ] + [(jnp.bfloat16, 128, True, False), (jnp.bfloat16, 256, False, True), (jnp.float32, 32, False, True),
         (jnp.float32, 64, False, True), (jnp.float32, 128, False, True), (jnp.float32, 256, False, True)]
    rows = []
    for dtype, head_dim, segments, causal in cases:
        for version, mod in versions.items():
            t0 = time.time()
            result = compile_kernels(mod, device, head_dim=head_dim, dtype=dtype, segments=segments, causal=causal)
            base = dict(version=version, dtype=jnp.dtype(dtype).name, head_dim=head_dim,
                        segments="yes" if segments else "no", causal="yes" if causal else "no")
            print(f"{version} {base['dtype']} D={head_dim} seg={segments} causal={causal}: {time.time() - t0:.1f} s",
                  flush=True)
            if isinstance(result, str):
                rows.append(dict(base, kernel="all", note=result))
                continue
            found, stages = result
            blocks = block_sizes(mod, head_dim, dtype)
            for name in ("fwd", "dkv", "dq"):
                k = found.get(name)
                if k is None:
                    rows.append(dict(base, kernel=name, note="kernel not found in the dump"))
                    continue
                bq, bk = tiles(blocks, name)
                rows.append(dict(base, kernel=name, **{"block_q x block_k": f"{bq} x {bk}"}, warps=k.warps,
                                 stages=stages.get(name, ""), shared_memory_bytes=k.shared_memory_bytes,
                                 registers=k.registers, spill_store_bytes=k.spill_store_bytes,
                                 spill_load_bytes=k.spill_load_bytes, wgmma=k.wgmma, **{
                                     "mma.sync": k.mma_sync, "TMA": k.tma, "cp.async": k.cp_async,
                                     "wgmma shapes": " ".join(k.wgmma_shapes), "blocks/SM": k.resident_blocks,
                                     "estimate best / no overlap": estimate_cell(version, dtype, head_dim, segments,
                                                                                 causal, blocks, name)}, note=""))

    meta = run_header(hardware="compile-only H100 (deviceless AOT on a CPU machine)",
                      before=f"{args.before_rev}:{KERNEL_FILE} (+ {BLOCKS_FILE})",
                      shapes="B=1, S=4096, H=Hkv=8, forward + backward (jax.grad of a sum)")
    with tempfile.TemporaryDirectory() as tmp:  # keep only the markdown (write_table also writes a CSV)
        md = pathlib.Path(write_table(pathlib.Path(tmp) / "kernel_ptxas_h100",
                                      "Pallas FlashAttention kernels on H100: ptxas figures and instruction mix, "
                                      "before and after",
                                      meta, COLS, rows)[1]).read_text()

    md += READING
    if not args.quick:
        md += "\n## After tuning, worst case over sequence lengths, segment ids, causal or not, MHA or GQA\n\n"
        md += ("Each row: the default blocks of that dtype and head_dim compiled for every combination of S "
               f"(bfloat16: {', '.join(map(str, VARIANT_SEQ_LENS['bfloat16']))}; float32: "
               f"{', '.join(map(str, VARIANT_SEQ_LENS['float32']))}), segment ids or not, causal or not, and 8 "
               "query heads over 8 or 2 KV heads. ptxas's register allocation moves with these (constants, loop "
               "bounds): the tuned blocks leave headroom below 255. float32 dots run on FMA units at full "
               "precision (no tensor cores); ptxas then trades a few spilled bytes for occupancy.\n\n")
        md += ("| dtype | head_dim | compiles | kernel | max registers | max spill bytes (store + load) | "
               "variants that spill | max shared_memory_bytes | max mma.sync | min wgmma | max TMA | min blocks/SM |\n"
               "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
        for dtype, head_dim in [(jnp.bfloat16, 64), (jnp.bfloat16, 128), (jnp.bfloat16, 256), (jnp.float32, 32),
                                (jnp.float32, 64), (jnp.float32, 128), (jnp.float32, 256)]:
            t0 = time.time()
            worst, n = variants(versions["after"], device, dtype, head_dim)
            print(f"variants {jnp.dtype(dtype).name} D={head_dim}: {n} compiles, {time.time() - t0:.0f} s", flush=True)
            for name in ("fwd", "dkv", "dq"):
                w = worst.get(name, {})
                md += (f"| {jnp.dtype(dtype).name} | {head_dim} | {n} | {name} | {w.get('registers', '')} | "
                       f"{w.get('spill', '')} | {w.get('spilled', '')} | {w.get('smem', '')} | "
                       f"{w.get('mma_sync', '')} | {w.get('wgmma', '')} | {w.get('tma', '')} | {w.get('blocks', '')} |\n")
            for error in worst.get("errors", []):
                md += f"\nerror: {error}\n"

    seq_lens = (2**22,) if args.quick else (2**21, 2**22)
    widths = {s: offset_widths(device, seq_len=s) for s in seq_lens}
    widenings = {s: ptx_widenings(device, seq_len=s) for s in seq_lens}
    md += "\n## Pointer offsets at the lengths we advertise (bfloat16, B=1, H=8, D=128, segment ids)\n\n"
    md += ("Triton IR: integer width of the offsets of every `tt.addptr` on a bfloat16 pointer (q, k, v, O, dO, "
           "dQ, dK, dV) in each kernel, `count x width`. Pallas's Triton lowering picks 64-bit offsets when the "
           "operand exceeds 2^32 bytes, i.e. for bfloat16 beyond 2^31 elements; up to 2^31 elements each offset "
           "(a sum of non-negative index x stride terms) is at most 2^31 - 1 and fits int32. PTX (XLA's compile): "
           "`mul.wide.s32 %rd, %r, 2` widens a 32-bit element offset of a 2-byte element to a 64-bit byte offset; "
           "`a of b` = widenings added to a global pointer of all widenings. At S = 4M the global addresses are "
           "built from 64-bit products (`mul.wide.u32 %rd, %r, <stride>`, `shl.b64`); the one widening left per "
           "kernel adds a pipeline-stage index to the shared-memory base `global_smem`.\n\n")
    md += "| S | elements of q | fwd IR | dkv IR | dq IR | fwd PTX | dkv PTX | dq PTX |\n"
    md += "|---|---|---|---|---|---|---|---|\n"
    for s in seq_lens:
        cells = [", ".join(f"{n} x {w}" for w, n in sorted(widths[s].get(f"flash_attention_{k}", {}).items()))
                 for k in ("fwd", "dkv", "dq")]
        cells += [str(widenings[s].get(k, "")) for k in ("fwd", "dkv", "dq")]
        md += f"| {s:,} | {s * 8 * 128:,} (2^{(s * 8 * 128).bit_length() - 1}) | " + " | ".join(cells) + " |\n"
    out = pathlib.Path(args.out_dir) / "kernel_ptxas_h100.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
