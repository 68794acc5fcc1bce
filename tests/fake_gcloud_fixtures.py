"""The `fake_cloud` fixture: the fake `gcloud` first on PATH, its metadata server running,
and every simulated host's processes killed at the end."""

from __future__ import annotations

import os
import tempfile

import pytest

from tests.fake_gcloud import FakeCloud
from tests.fake_metadata import MetadataServer


@pytest.fixture
def fake_cloud(tmp_path, monkeypatch) -> FakeCloud:
    cloud = FakeCloud(str(tmp_path / "cloud"))
    server = MetadataServer(cloud).start()
    bin_dir = str(tmp_path / "bin")
    cloud.install_shim(bin_dir, server.url)
    monkeypatch.setenv("PATH", bin_dir + os.pathsep + os.environ["PATH"])
    # The jobs' directories (wheel, spec, staging copy) go with the test's files.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setenv("TMPDIR", str(tmp))
    try:
        yield cloud
    finally:
        for name in list(cloud.read()["tpus"]):
            cloud.kill_hosts(name)
        server.stop()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pod_config(path, run: str, model: str, tokenizer: str, sources: list[dict],
               accelerator_type: str = "v4-32", batch_size: int = 16, **tpu) -> str:
    """A submit config for the tpu-vm target on the fake cloud: a spot queued resource,
    prepare here, no `jax[tpu]` (the hosts' "image" has JAX), fast polls and log copies."""
    import yaml

    cfg = {
        "run": run,
        "spec": {
            "name": "pod",
            "model": {"path": model, "dtype": "float32"},
            "tokenizer": {"path": tokenizer},
            "sources": sources,
            "packing": {"mode": "segmented", "seq_len": 32},
            "capture": {"hooks": "layers.*.resid_post", "dtype": "bfloat16"},
            "layout": {"rows_per_shard": 4, "partition_rows": 16},
        },
        "target": {
            # Hosts agree on finished partitions every 2 steps: commits come one by one, so
            # a preemption after the first leaves most of the run to do.
            "kind": "tpu-vm", "prepare": "local", "batch_size": batch_size, "heartbeat_s": 1,
            "stop_check_steps": 2,
            "tpu": {"name": "pod1", "zone": "us-central2-b", "project": "proj",
                    "accelerator_type": accelerator_type, "create": True,
                    "queued_resource": True, "spot": True, "coordinator_port": free_port(),
                    "jax_requirement": "", "poll_s": 0.2, "log_every_s": 1, **tpu},
        },
    }
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return str(path)
