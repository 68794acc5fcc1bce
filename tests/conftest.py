"""Shared test setup: 8 CPU devices for JAX (set before jax is first imported)."""

import os

import pytest

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# The tests' programs are tiny models run a few times: compiling them is most of the
# suite's time, and LLVM's optimisation of the CPU code most of the compile. Level 1
# compiles in about three quarters of the time (tests/test_model.py alone, no cache: 40 s
# -> 30 s) and computes the same bits as the default level: LLVM forms the same fused
# multiply-adds and, without fast-math (XLA CPU's default), reorders no float arithmetic.
# (Level 0 forms no fused multiply-adds: programs the byte-identity tests compare then
# round differently.) ACTX_TEST_XLA_OPT=1 keeps the default level.
if os.environ.get("ACTX_TEST_XLA_OPT", "0") == "0":
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Deterministic CPU numerics for parity tests; tests that need float64 ask for it locally.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One persistent XLA compilation cache for the test processes and every worker process
# they start (inherited through the environment): the tiny models' steps, compiled by
# dozens of worker processes, compile once. An entry is keyed by the program, the XLA
# flags and the devices, so a hit runs the very code a compile would make; the parity
# tests hold either way. Least recently used entries go past 2 GiB.
# ACTX_TEST_JAX_CACHE=0 compiles everything afresh.
if os.environ.get("ACTX_TEST_JAX_CACHE", "1") != "0":
    import tempfile

    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                          os.path.join(tempfile.gettempdir(), f"actx-tests-jax-cache-{os.getuid()}"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))

pytest_plugins = ["tests.fixtures", "tests.reader_fixtures", "tests.pipeline_fixtures"]

# GCS clients read their endpoint once, so it is fixed before any test imports them.
from tests import gcs_emulator  # noqa: E402

gcs_emulator.reserve_endpoint()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "real_slurm: runs against the real two-node Slurm cluster that "
        "tests/slurm_cluster.sh starts (.ci/run does); skips, saying why, without one")


@pytest.fixture(autouse=True, scope="session")
def _lines_printed_whole():
    """No COLUMNS in the tests' environment, or their actx processes' (deploy.columns
    would wrap what they print): neither a terminal's exported one nor the one GNU
    readline puts into the process environment when pytest imports it (os.environ does
    not see that one, the children inherit it). tests/test_eighty_columns.py sets it."""
    os.environ.pop("COLUMNS", None)
    os.unsetenv("COLUMNS")
