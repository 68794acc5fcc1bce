"""Pytest fixtures shared by the suite: the GCS emulator and per-test buckets."""

from __future__ import annotations

import itertools
import uuid

import pytest

from tests import gcs_emulator

_BUCKETS = itertools.count()


@pytest.fixture(scope="session")
def gcs_emulator_server():
    server = gcs_emulator.Emulator(gcs_emulator.reserve_endpoint()).start()
    yield server
    server.stop()


@pytest.fixture
def gcs_bucket(gcs_emulator_server) -> str:
    """A fresh, empty bucket on the emulator: 'gs://<name>'."""
    return gcs_emulator_server.create_bucket(f"actx-{next(_BUCKETS)}-{uuid.uuid4().hex[:8]}")
