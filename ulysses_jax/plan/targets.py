"""Compile-only GPU targets: H100 and H200 devices that exist only for XLA's compiler.

With the CUDA plugin installed (``pip install 'ulysses-jax[aot]'`` or ``[gpu]``), XLA compiles a program for a
made-up topology of GPUs on a machine that has none ("deviceless" ahead-of-time compilation): the real GPU
buffer assignment, the GPU-optimised HLO with its collectives, and Pallas kernels lowered through Triton to PTX
for ``sm_90a``. ``target_devices("h100", devices=8)`` returns such devices; put them in a mesh
(``make_mesh(..., devices=...)``) and ``jax.jit(f).trace(*abstract_args).lower().compile()``.

Each target is a ``GpuTargetConfigProto`` in text format beside this file (``h100.txtpb``, ``h200.txtpb``), written
from the devices' CUDA properties, plus the figures the planner needs that XLA does not (``GpuTarget``): dense
bf16 peak and link bandwidths, nominal datasheet values, used only for lower bounds labelled as such.

Nothing else in the package knows about targets: the code below it asks the mesh's devices for their platform
(``device.platform == "gpu"``), which compile-only devices answer like real ones.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

import jax

HERE = pathlib.Path(__file__).parent
PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12", "jax_cuda13_plugin", "jax_cuda12_plugin")
INSTALL_HINT = ("pip install 'ulysses-jax[aot]' (the CUDA plugin, jax[cuda13]; or [aot-cuda12] for jax[cuda12]; Linux "
                "x86_64, no GPU needed)")


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    name: str
    device_kind: str  # what jax.Device.device_kind reports
    memory_bytes: int  # device memory (CUDA total global memory)
    peak_flops: float  # dense bf16 FLOP/s (datasheet)
    hbm_bytes_per_s: float  # device memory bandwidth
    nvlink_bytes_per_s: float  # per GPU, one direction, within a host
    host_link_bytes_per_s: float  # per GPU, one direction, to pinned host memory (PCIe gen5 x16, nominal)
    network_bytes_per_s: float  # per GPU, one direction, between hosts (one 400 Gb/s NIC per GPU)
    gpus_per_host: int = 8
    host_memory_bytes: int = 2 * 10**12  # the host memory of one node (the node assumed: see ``node``)
    node: str = ""  # the node the host budget assumes, in words

    @property
    def host_budget_bytes(self) -> int:
        """Pinned host memory per GPU a plan may use by default: ``HOST_SHARE`` of the node's memory over its GPUs
        (the rest for the OS, the process and the data pipeline)."""
        return int(HOST_SHARE * self.host_memory_bytes / self.gpus_per_host)

    @property
    def spec_file(self) -> pathlib.Path:
        return HERE / f"{self.name}.txtpb"

    def spec(self) -> str:
        """The ``GpuTargetConfigProto`` text XLA compiles against."""
        return self.spec_file.read_text()


HOST_SHARE = 0.9  # of a node's host memory, the share pinned buffers may take (the rest: OS, process, data loading)
TARGETS: dict[str, GpuTarget] = {
    "h100": GpuTarget("h100", "NVIDIA H100 80GB HBM3", 84_942_979_072, 989e12, 3.35e12, 450e9, 64e9, 50e9,
                      node="8 x H100 SXM with 2 TB of host memory (a DGX H100)"),
    "h200": GpuTarget("h200", "NVIDIA H200", 150_754_820_096, 989e12, 4.8e12, 450e9, 64e9, 50e9,
                      node="8 x H200 SXM with 2 TB of host memory (a DGX H200)"),
}


def get_target(name: str) -> GpuTarget:
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)} with --target")
    return TARGETS[name]


def cuda_plugin_installed() -> bool:
    return any(_has_module(m) for m in PLUGINS)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def target_devices(name: str, *, devices: int, hosts: int = 1) -> list[jax.Device]:
    """``devices`` compile-only GPUs of target ``name`` over ``hosts`` hosts (``devices / hosts`` per host).

    Raises ``ValueError`` with the fix for an unknown target, counts that do not divide, or a missing plugin.
    """
    target = get_target(name)
    if not isinstance(devices, int) or devices < 1 or not isinstance(hosts, int) or hosts < 1:
        raise ValueError(f"--devices ({devices}) and --hosts ({hosts}) must be positive integers")
    if devices % hosts:
        raise ValueError(f"--devices ({devices}) must be a multiple of --hosts ({hosts}): each host holds as many GPUs")
    if devices // hosts > target.gpus_per_host:  # else more GPUs than a node holds would share its NVLink
        raise ValueError(f"--devices ({devices}) over --hosts ({hosts}) puts {devices // hosts} GPUs in a host, but an "
                         f"{target.name} host holds {target.gpus_per_host}; pass --hosts "
                         f"{-(-devices // target.gpus_per_host)}")
    if not cuda_plugin_installed():
        raise ValueError(f"compiling for {target.name} needs the CUDA plugin of jaxlib, which is not installed: "
                         f"{INSTALL_HINT}")
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=target.spec(), topology=f"1x{hosts}x{devices // hosts}"
        )
    except NotImplementedError:
        raise ValueError(
            "the CUDA plugin is installed but did not register (on a machine without a GPU it fails its start-up "
            "check): set JAX_PLATFORMS=cpu or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before JAX starts "
            "(the ulysses-jax command does this itself)"
        ) from None
    return list(topo.devices)


def no_gpu_here() -> bool:
    """True when this machine has no NVIDIA driver device: the CUDA plugin's start-up check would fail."""
    return not pathlib.Path("/dev/nvidiactl").exists()
