"""Test setup: 8 fake CPU devices, configured before JAX initialises its backend."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# One compilation cache for the processes of a test run (the xdist workers and the CLI subprocesses they start): many
# tests compile the same small programs (the tiny model's step, the CLI's), and compiling is most of a CPU test's
# time. XLA keys an entry by the program, the compile options and the versions, so a hit is the same executable.
# Kept in .jax_cache/ (ignored by git, removed by `make clean`); a fresh clone starts empty.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# With the CUDA plugin installed (the aot extra) on a machine without a GPU, the plugin's start-up check fails and
# it does not register; skipping the check lets it register for compile-only H100 targets (tests marked aot).
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

from ulysses_jax.plan.targets import INSTALL_HINT, cuda_plugin_installed  # noqa: E402

# Kept out of the default `make test` (run by `make test-slow`) to hold it near 15 minutes on 2 cores: each repeats
# coverage that a faster variant in the default suite keeps (another mesh, dtype or jit mode of the same check), or
# is a smoke run of a benchmark script or a second multi-process run (tests/test_hf.py runs two processes too).
SLOW = frozenset({
    "tests/test_experiments.py::test_benchmark_smoke[bench_train.py]",
    "tests/test_experiments.py::test_benchmark_smoke[bench_attention.py]",
    "tests/test_multiprocess.py::test_two_processes_train_resume_and_continue_on_one",
    "tests/test_multiprocess.py::test_ring_across_two_processes_equals_one",
    # the default suite keeps the kill of process 1 (the watchdog's line); the others of test_cluster.py are marked slow
    "tests/test_cluster.py::test_a_lost_process_ends_the_job_with_one_line[0]",
    # the default suite keeps the failure of process 1 (its peer, process 0, hosts the store it writes its mark to)
    "tests/test_cluster.py::test_a_failed_process_ends_the_job_with_one_line[0]",
    "tests/test_step.py::test_offloaded_optimizer_equals_the_on_device_one[bfloat16-True]",
    "tests/test_step.py::test_grad_accumulation_equals_large_batch[dp2xfsdp2xsp2]",
    "tests/test_model.py::test_sharded_equals_single_device[fsdp8-gqa-llama3]",
    "tests/test_model.py::test_remat_every_second_layer_same_gradients[full]",
    "tests/test_ulysses.py::test_inputs_in_other_shardings[eager]",
    "tests/test_loss.py::test_tiled_loss_equals_plain[sp4-gqa-llama3]",
    "tests/test_sharding.py::test_same_seed_same_parameters_on_any_mesh",  # test_model: SP=P == SP=1 from the init
    # covered in the default suite by the planner's own tests (test_plan.py) and notebooks 01-02
    "tests/test_notebooks.py::test_notebook_runs[03_plan_a_cluster_run]",
    # trains and evaluates; the same paths run in the default suite by tests/test_eval_tasks_cli.py
    "tests/test_notebooks.py::test_notebook_runs[04_did_the_long_context_take]",
    # train-then-eval and mesh-changing resume are also covered by test_eval_reads_the_run_and_refuses_other_data
    # and test_step.py::test_checkpoint_restores_onto_another_mesh
    "tests/test_cli.py::test_pulse_train_then_eval",
    "tests/test_cli.py::test_resume_onto_another_mesh_from_an_earlier_step",
    # sp=2 and MHA with bias stay covered by fsdp4xsp2 and fsdp2xsp4-mha-bias; the tiled MLP by two other meshes
    "tests/test_model.py::test_sharded_equals_single_device[sp2-mha-bias]",
    "tests/test_model.py::test_tiled_mlp_equals_plain[sp4]",
    # MoE on fsdp 2 x sp 4 stays in the default suite with the tiled MLP and remat (variant1) and in the parity of
    # tests/test_moe_hf.py (plain, sharded)
    "tests/test_moe.py::test_eight_devices_equal_one[variant0]",
    # remat_every 2 ([2]) stays in the default suite and counts the same forward runs; notebook 01 stays
    "tests/test_kept_attention.py::test_the_compiled_step_runs_attention_forward_once_per_layer[1]",
    "tests/test_notebooks.py::test_notebook_runs[02_model_on_fake_devices]",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)
    # aot tests compile for H100s without a GPU; they need the CUDA plugin (`make test` installs it on Linux).
    # In CI (CI set) they always run, so a missing plugin fails there instead of passing by skipping.
    skip_aot = None
    if not cuda_plugin_installed() and not os.environ.get("CI"):
        skip_aot = pytest.mark.skip(reason=f"needs the CUDA plugin: {INSTALL_HINT}")
    skip_gpu = None if jax.default_backend() == "gpu" else pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        if skip_aot is not None and "aot" in item.keywords:
            item.add_marker(skip_aot)


# Fresh random inputs on every run, reproducible on demand: each test draws from
# crc32(test id) ^ base seed, where the base seed is new each session unless
# ULYSSES_TEST_SEED is set; it is printed in the report header.
import random  # noqa: E402
import zlib  # noqa: E402

BASE_SEED = int(os.environ.get("ULYSSES_TEST_SEED", random.SystemRandom().randrange(2**31)))


def pytest_report_header(config):
    return f"ulysses_jax: random inputs with ULYSSES_TEST_SEED={BASE_SEED} (set it to reproduce)"


@pytest.fixture
def seed(request):
    return (zlib.crc32(request.node.nodeid.encode()) ^ BASE_SEED) % 2**31
