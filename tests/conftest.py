"""Shared test setup: 8 CPU devices for JAX (set before jax is first imported)."""

import os
import sys
import tempfile

import pytest

# Bytecode, cached: an environment that sets PYTHONDONTWRITEBYTECODE=1 (this project's
# development and CI machines do) has every process the tests start (hundreds: workers,
# launchers, prepare, the CLI) compile each actx module it imports from source. Importing
# the worker, CLI, prepare and reader modules took 4.4 s a process without a cache and 2.7 s
# with one (2026-12-07, best of 3). The tests and their processes keep bytecode under one
# folder of the temp dir, so the checkout gains no __pycache__.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) or sys.dont_write_bytecode:
    os.environ.setdefault("PYTHONPYCACHEPREFIX", os.path.join(
        tempfile.gettempdir(), f"actx-tests-pycache-{os.getuid()}"))
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"]
    sys.dont_write_bytecode = False

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# The tests' programs are tiny models run a few times: compiling them is a large share of the
# suite's time (XLA's compile was 55% of a parity file's), so the tests compile with two
# options that make it cheaper. LLVM's optimisation level 1 (tests/test_model.py alone, no
# cache: 40 s -> 30 s), and XLA's elemental emitters in place of its fusion emitters
# (2026-12-07, no cache, compile time measured around each compile: tests/test_model.py
# 45 -> 31 core-s; test_families_gpt_oss + test_long_documents 211 -> 142 core-s of
# compiling, 269 -> 202 core-s in all). The values differ from the defaults' by rounding
# only (level 1 checked on matmuls, norms, softmax, rotary tables, erf/silu/gelu/tanh,
# logsumexp, cumulative sums: most bit for bit, some within 4e-5 relative, where sums are
# ordered otherwise), and no comparison in the suite crosses the two: a parity test
# compares with HF within its tolerance, and a byte-identity test compares runs that all
# compiled with these options (worker processes get them: tests/worker_procs.xla_flags,
# and the local target passes a user's XLA_FLAGS on to its workers). (Level 0 was
# rejected: it forms no fused multiply-adds, and three byte-identity tests, a one-host
# program against its two-host form, rounded apart.)
# ACTX_TEST_XLA_OPT=1 runs the suite at the defaults users get.
if os.environ.get("ACTX_TEST_XLA_OPT", "0") == "0":
    os.environ["XLA_FLAGS"] += (" --xla_backend_optimization_level=1"
                                " --xla_cpu_use_fusion_emitters=false")
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
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                          os.path.join(tempfile.gettempdir(), f"actx-tests-jax-cache-{os.getuid()}"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))

pytest_plugins = ["tests.fixtures", "tests.reader_fixtures", "tests.pipeline_fixtures"]

# GCS clients read their endpoint once, so it is fixed before any test imports them.
from tests import gcs_emulator  # noqa: E402

gcs_emulator.reserve_endpoint()


# The files that take longest, heaviest first (a cold suite on two cores, 2026-12-06; the
# real Slurm cluster's file as .ci/run times it): README's command hands each of its
# processes a whole file at a time (--dist loadfile), in collection order, and a long file
# handed out last keeps one process busy after the others have run out of files. Started
# first, they leave the short ones to fill in (about 80 s less of the suite, simulated on
# those timings). Files not named keep their order, after these.
LONGEST_FIRST = (
    "test_long_documents", "test_slurm_real", "test_interrupts", "test_moe_layouts",
    "test_families_gpt_oss", "test_worker_pipeline", "test_generate", "test_extract",
    "test_beam_extract", "test_model", "test_families_gpt", "test_pod_journey",
    "test_extractions", "test_request_bench", "test_moe", "test_bucket_refusals",
    "test_float8", "test_generate_multihost", "test_store_faults", "test_key_ranges",
    "test_generate_run", "test_bad_inputs", "test_advice_followed", "test_eighty_columns",
    "test_generate_tpu_vm", "test_decode_flash", "test_input_formats",
    "test_pod_journey_failures", "test_ops_submit", "test_flax_submit",
    "test_long_documents_workers", "test_prepare_faults", "test_cached_attention",
    "test_verify_reference_flax", "test_slurm_target", "test_schedule_sim",
    "test_generate_kill", "test_run_removed", "test_end_to_end", "test_disk_faults",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable


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
