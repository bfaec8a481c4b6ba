"""Test setup: 8 fake CPU devices, configured before JAX initialises its backend."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
