"""The devices a job runs on: the ``--mesh.*`` flags resolved (``sp`` automatic by default), the default batch, and
every divisibility the training step needs, checked before anything is computed with the flags' own names.

Shared by ``train``, ``eval`` and ``plan`` (which resolves the same flags over compile-only GPUs).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax

from ulysses_jax.kernels.attention import auto_reason, device_platform, resolve_impl
from ulysses_jax.kernels.cudnn_packed import resolve_max_documents
from ulysses_jax.model.config import ModelConfig, local_chunks
from ulysses_jax.parallel.head_layout import head_groups, plan_heads
from ulysses_jax.parallel.mesh import RING, make_mesh
from ulysses_jax.parallel.ring import RING_IMPLS


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1  # replicas
    fsdp: int = -1  # batch and parameter sharding; -1: the devices left after data, ring and sp
    ring: int = 1
    """ring attention across hosts (Ulysses x ring): the sequence is split over ring x sp and K/V blocks travel
    around the ring; 1: plain Ulysses. Use it when the sequence no longer fits one host's sp group"""
    sp: int = 0
    """Ulysses sequence parallelism (innermost: devices of one host); 0: auto, the most devices of one host that
    divide the query heads and --seq-len (all 8 on one 8-GPU node or 8 fake CPU devices); with --mesh.fsdp given, the
    devices left"""


def build_mesh(m: MeshConfig, model: ModelConfig, seq_len: int, devices=None) -> jax.sharding.Mesh:
    """The mesh of the ``--mesh.*`` flags over ``devices`` (default: all), ``sp=0`` resolved (see ``MeshConfig``)."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    for name, v, ok, what in (
        ("data", m.data, m.data >= 1, "a positive number"),
        ("fsdp", m.fsdp, m.fsdp >= 1 or m.fsdp == -1, "a positive number or -1 (the devices left)"),
        ("ring", m.ring, m.ring >= 1, "a positive number"),
        ("sp", m.sp, m.sp >= 0, "a positive number or 0 (auto)"),
    ):
        if not ok:
            raise ValueError(f"--mesh.{name} ({v}) must be {what} of devices")
    data, fsdp, ring, sp = m.data, m.fsdp, m.ring, m.sp
    ring_flag = f" x --mesh.ring {ring}" if ring > 1 else ""
    if sp == 0 and fsdp != -1:
        sp = n // (data * fsdp * ring) if n % (data * fsdp * ring) == 0 else 0
        if sp == 0:
            raise ValueError(f"--mesh.data {data} x --mesh.fsdp {fsdp}{ring_flag} = {data * fsdp * ring} does not "
                             f"divide the {n} devices; choose sizes whose product divides {n}")
    elif sp == 0:
        sp = _auto_sp(m, model, seq_len, devices)
    if fsdp == -1:
        if n % (data * ring * sp):
            raise ValueError(f"--mesh.data {data}{ring_flag} x --mesh.sp {sp} = {data * ring * sp} does not divide "
                             f"the {n} devices; choose sizes whose product divides {n}")
        fsdp = n // (data * ring * sp)
    if data * fsdp * ring * sp != n:
        raise ValueError(f"--mesh.data {data} x --mesh.fsdp {fsdp}{ring_flag} x --mesh.sp {sp} = "
                         f"{data * fsdp * ring * sp} but there are {n} devices; make the product {n} (or let "
                         f"--mesh.fsdp -1 take the devices left)")
    return make_mesh(data=data, fsdp=fsdp, ring=ring, sp=sp, devices=devices)


def _auto_sp(m: MeshConfig, model: ModelConfig, seq_len: int | None, devices) -> int:
    """The sp that ``sp=0`` resolves to with ``fsdp=-1``; ``seq_len=None``: whatever the length (the most it can be)."""
    n = len(devices)
    per_host = n // len({d.process_index for d in devices})
    seq_ring = seq_len // m.ring if seq_len is not None and seq_len % m.ring == 0 else 0
    fits = [d for d in range(per_host, 0, -1) if per_host % d == 0 and d <= model.num_heads
            and n % (m.data * m.ring * d) == 0 and (seq_len is None or seq_ring % d == 0) and _delta_fits(model, d)]
    return fits[0] if fits else 1


def _delta_fits(model: ModelConfig, sp: int) -> bool:
    """Whether a hybrid's delta-net heads split over ``sp`` (``parallel/ulysses_delta.plan_delta_heads``)."""
    hk, hv = model.linear_num_key_heads, model.linear_num_value_heads
    return not model.linear_layers or (hv % sp == 0 and (hk % sp == 0 or sp % hk == 0))


def sequence_multiple(m: MeshConfig, devices=None) -> int:
    """The multiple of which ``--seq-len`` keeps the sequence split as the ``--mesh.*`` flags ask: ``ring x sp``
    (and ``2 x ring``, the zigzag order); with ``sp`` auto, the devices of a host in place of ``sp``."""
    devices = list(jax.devices() if devices is None else devices)
    sp = m.sp or len(devices) // len({d.process_index for d in devices})
    return math.lcm(m.ring * sp, 2 * m.ring) if m.ring > 1 else sp


def auto_sp_note(m: MeshConfig, model: ModelConfig, seq_len: int, mesh) -> str | None:
    """Why an automatic ``sp`` (``--mesh.sp 0``) is smaller than the devices allow, with the length that keeps them
    all: ``--seq-len`` not a multiple of them. None when nothing fell."""
    if m.sp or m.fsdp != -1:
        return None
    devices = list(mesh.devices.flat)
    best = _auto_sp(m, model, None, devices)
    got = mesh.shape["sp"]
    if got >= best:
        return None
    unit = best * m.ring
    return (f"sp {got}, not {best}: --seq-len {seq_len} is not a multiple of {unit}; --seq-len "
            f"{-(-seq_len // unit) * unit} (or --mesh.sp {best}, which refuses this length) keeps sp {best}")


def sp_note(m: MeshConfig, model: ModelConfig, seq_len: int, mesh) -> str:
    """``auto_sp_note`` as the start line's parenthesis (empty when nothing fell)."""
    note = auto_sp_note(m, model, seq_len, mesh)
    return f" ({note})" if note else ""


def impl_note(m: ModelConfig, mesh) -> str:
    """The start line's attention kernel: ``auto -> cudnn`` (with why ``auto`` did not pick cuDNN, where it did not)."""
    # training rows are packed documents: segment ids are always present
    platform = device_platform(mesh)
    impl = resolve_impl(m.attention_impl, dtype=m.compute_jnp_dtype, head_dim=m.head_dim, has_segment_ids=True,
                        platform=platform, sinks=m.attn_sinks)
    unused = ([f"--attn-max-documents {m.attn_max_documents} applies to cuDNN only: unused"]
              if m.attn_max_documents and impl != "cudnn" else [])
    if impl == m.attention_impl:
        return "; ".join([impl, *unused])
    why = auto_reason(dtype=m.compute_jnp_dtype, head_dim=m.head_dim, platform=platform,
                      ring=mesh.shape.get("ring", 1), sinks=m.attn_sinks)
    notes = [w for w in (why, *unused) if w]
    return f"{m.attention_impl} -> {impl}" + (f" ({'; '.join(notes)})" if notes else "")


def resolve_batch(batch_size: int | None, mesh, grad_accum: int = 1) -> int:
    """``--batch-size``, or by default 2 rows, or one per data x fsdp device (times ``--grad-accum``) if more."""
    if grad_accum < 1:  # before the default batch divides by it (check_parallel says it for a given batch)
        raise ValueError(f"--grad-accum ({grad_accum}) must be at least 1")
    if batch_size is not None:
        return batch_size
    rows = mesh.shape["data"] * mesh.shape["fsdp"] * grad_accum
    return rows * -(-2 // rows)


def check_parallel(cfg: ModelConfig, mesh, *, seq_len: int, batch_size: int, grad_accum: int = 1) -> None:
    data, fsdp, ring, sp = (mesh.shape[a] for a in ("data", "fsdp", "ring", "sp"))
    if ring == 1 and (seq_len < 1 or seq_len % sp):
        raise ValueError(f"--seq-len ({seq_len}) must be a positive multiple of --mesh.sp ({sp})")
    unit = math.lcm(ring * sp, 2 * ring)
    if ring > 1 and (seq_len < 1 or seq_len % unit):
        raise ValueError(f"--seq-len ({seq_len}) must be a positive multiple of --mesh.ring x --mesh.sp "
                         f"({ring} x {sp}) and of 2 x --mesh.ring ({2 * ring}, the zigzag order): a multiple of {unit}")
    if sp > cfg.num_heads:
        raise ValueError(
            f"--mesh.sp ({sp}) exceeds the model's query heads ({cfg.num_heads}): Ulysses splits heads over sp; "
            f"use --mesh.sp <= {cfg.num_heads}"
        )
    rows = data * fsdp
    if grad_accum < 1:
        raise ValueError(f"--grad-accum ({grad_accum}) must be at least 1")
    if batch_size < 1 or batch_size % grad_accum or (batch_size // grad_accum) % rows:
        raise ValueError(
            f"--batch-size ({batch_size}) must be a multiple of --grad-accum ({grad_accum}) x --mesh.data x "
            f"--mesh.fsdp ({data} x {fsdp}) = {grad_accum * rows}"
        )
    hosts = len({d.process_index for d in mesh.devices.flat})  # the mesh's, so a planned topology counts too
    per_host = mesh.devices.size // hosts
    row_hosts = max(1, ring * sp // per_host)  # hosts that share one row's sequence (a ring across hosts)
    if batch_size % (hosts // row_hosts or 1):
        raise ValueError(f"--batch-size ({batch_size}) must be divisible by the {hosts // row_hosts} processes (hosts) "
                         f"that hold separate rows")
    if ring > 1 and cfg.attention_impl not in RING_IMPLS:
        raise ValueError(f"--attention {cfg.attention_impl} has no ring kernel; with --mesh.ring {ring} use "
                         f"--attention {', '.join(RING_IMPLS)}")
    if hosts > 1 and per_host % sp and sp % per_host:
        raise ValueError(
            f"--mesh.sp ({sp}) must divide the {per_host} devices of each host, so that an sp group stays within "
            f"one host (or be a multiple of them: whole hosts, the all-to-alls over the network); use --mesh.sp <= "
            f"{per_host}, and --mesh.ring to span hosts"
        )
    for flag, chunk in (("--loss-chunk", cfg.loss_chunk), ("--mlp-chunk", cfg.mlp_chunk),
                        ("--attn-chunk", cfg.attn_chunk)):
        if chunk:
            local_chunks(chunk, seq_len // (ring * sp), flag)
    if cfg.attn_chunk and ring > 1:
        raise ValueError(f"--attn-chunk ({cfg.attn_chunk}) tiles the Ulysses exchange of a mesh without a ring; with "
                         f"--mesh.ring {ring} use --attn-chunk 0")
    if cfg.attn_keep and ring > 1:
        raise ValueError(f"--attn-keep keeps the attention output of Ulysses alone; with --mesh.ring {ring} each ring "
                         f"step's partial attention has its own backward: drop --attn-keep or use --mesh.ring 1")
    if cfg.attn_head_chunk:
        head_groups(plan_heads(cfg.num_heads, cfg.num_kv_heads, sp), cfg.attn_head_chunk, flag="--attn-head-chunk")
    # training rows are packed documents, so segment ids are always present
    if ring > 1:
        return  # the ring's kernels serve any platform, dtype and head_dim
    try:
        resolve_impl(cfg.attention_impl, dtype=cfg.compute_jnp_dtype, head_dim=cfg.head_dim, has_segment_ids=True,
                     platform=device_platform(mesh), sinks=cfg.attn_sinks)
    except ValueError as e:
        why = str(e).replace(f"impl={cfg.attention_impl!r} ", "")
        why = re.sub(r"impl='(\w+)'( or '(\w+)')?", r"--attention \1\2", why)
        why = re.sub(r"'(\w+)'", r"\1", why)
        raise ValueError(f"--attention {cfg.attention_impl}: {why}") from None


# ------------------------------------------------------------------------------------ the GPU memory pool

DEFAULT_MEMORY_FRACTION = 0.95  # what `plan`'s default budget (0.9 of the device) assumes: see memory_pool
MEMORY_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
_set_by_us: list[str] = []  # the value this process wrote into the environment (a second in-process run may change it)


def check_memory_fraction(fraction: float | None) -> float:
    """``--memory-fraction`` resolved (None: ``DEFAULT_MEMORY_FRACTION``) and checked."""
    value = DEFAULT_MEMORY_FRACTION if fraction is None else fraction
    if not 0 < value < 1:
        raise ValueError(f"--memory-fraction ({value}) must be in (0, 1), e.g. {DEFAULT_MEMORY_FRACTION}: the share of "
                         f"each GPU's memory JAX's pool takes, the rest left to the CUDA context and NCCL")
    return value


def memory_pool(fraction: float | None, environ: dict) -> tuple[float, str]:
    """The share of each GPU's memory JAX's pool takes, and where it comes from.

    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` set by the user wins (it is the process-wide setting JAX reads); otherwise
    ``--memory-fraction`` (default ``DEFAULT_MEMORY_FRACTION``, what ``plan``'s budget assumes: XLA's buffers within
    0.9 of the device, 0.05 of the pool for fragmentation, 0.05 of the device outside the pool).
    """
    value = check_memory_fraction(fraction)
    env = environ.get(MEMORY_FRACTION_ENV)
    if env is not None and not (_set_by_us and env == _set_by_us[-1]):
        try:
            return float(env), f"{MEMORY_FRACTION_ENV}={env} from the environment (it overrides --memory-fraction)"
        except ValueError:
            raise ValueError(f"{MEMORY_FRACTION_ENV}={env!r} in the environment is not a number; unset it or set it "
                             f"to a fraction such as {DEFAULT_MEMORY_FRACTION}") from None
    source = "--memory-fraction" if fraction is not None else "--memory-fraction default, what plan's budget assumes"
    return value, source


def apply_memory_pool(fraction: float | None, environ: dict) -> tuple[float, str]:
    """``memory_pool``, written into ``environ`` for JAX's GPU client (call before JAX starts its backends)."""
    value, source = memory_pool(fraction, environ)
    if source.startswith("--memory-fraction"):
        environ[MEMORY_FRACTION_ENV] = str(value)
        _set_by_us.append(str(value))
    return value, source


def device_total_bytes(mem) -> int | None:
    """XLA's per-device memory of a compiled program: argument + output + temp - alias (``memory_analysis()``)."""
    if mem is None:
        return None
    return mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes


def documents_limit(model: ModelConfig, mesh, seq_len: int) -> int | None:
    """The bound on documents per row the step was compiled for when attention runs on cuDNN's packed layout (its
    ``attn_max_documents``, or the default for ``seq_len``), else None: every other kernel takes any number of
    documents, and a ring (``ring > 1``) runs our kernel in each ring step whatever ``attention_impl`` says."""
    if mesh.shape.get(RING, 1) > 1:
        return None
    impl = resolve_impl(model.attention_impl, dtype=model.compute_jnp_dtype, head_dim=model.head_dim,
                        has_segment_ids=True, platform=device_platform(mesh), sinks=model.attn_sinks)
    return resolve_max_documents(model.attn_max_documents, seq_len) if impl == "cudnn" else None
