"""Shared test setup: 8 CPU devices for JAX (set before jax is first imported)."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Deterministic CPU numerics for parity tests; tests that need float64 ask for it locally.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = ["tests.fixtures", "tests.reader_fixtures", "tests.pipeline_fixtures"]

# GCS clients read their endpoint once, so it is fixed before any test imports them.
from tests import gcs_emulator  # noqa: E402

gcs_emulator.reserve_endpoint()
