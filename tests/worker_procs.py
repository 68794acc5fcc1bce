"""Launch extraction workers as real OS processes (one per simulated host) in tests."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import numpy as np

from actx.schemas import uri

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def xla_flags(devices: int) -> str:
    """The tests' XLA flags (tests/conftest.py: the compile options every test process
    shares) with `devices` simulated CPU devices: a worker process's XLA_FLAGS."""
    from actx.deploy import local

    return local.with_host_devices(os.environ.get("XLA_FLAGS", ""), devices)


def worker_env(devices: int, **extra: str) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags(devices)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("ACTX_CRASH_AT", None)
    env.update(extra)
    return env


def start_worker(args: list[str], devices: int = 4, module: str = "actx.workers.main",
                 **env: str) -> subprocess.Popen:
    """`python -m module` (the worker's entry point, or a test's wrapper of it)."""
    return subprocess.Popen([sys.executable, "-m", module, *args],
                            env=worker_env(devices, **env), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def run_worker(args: list[str], devices: int = 4, timeout: float = 300,
               **env: str) -> tuple[int, str]:
    return finish(start_worker(args, devices, **env), timeout)


def run_replica(run: str, hosts: int, devices_per_host: int, extra: list[str] = (),
                timeout: float = 300, module: str = "actx.workers.main", host_env=None,
                **env: str) -> list[tuple[int, str]]:
    """One replica of `hosts` processes joined by jax.distributed on loopback.
    host_env(i): environment variables for process i only."""
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [start_worker(["--run", run, "--coordinator", coordinator,
                           "--num-processes", str(hosts), "--process-id", str(i), *extra],
                          devices_per_host, module, **env, **(host_env(i) if host_env else {}))
             for i in range(hosts)]
    return [finish(p, timeout) for p in procs]


def stored_objects(run_dir: str, prefix: str = "activations") -> dict[str, bytes]:
    """Every stored object under `prefix` of a local run, by relative key."""
    root = uri.parse(run_dir).path
    out = {}
    for dirpath, _, files in os.walk(os.path.join(root, prefix)):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def copy_token_store(src: str, dest: str) -> str:
    """A new local run with `src`'s token store (its doc table too) and specs, no
    activations or commits."""
    os.makedirs(dest)
    for name in ("run.json", "manifest.json", "tokens", "docs"):
        path = os.path.join(src, name)
        if name == "docs" and not os.path.exists(path):
            continue  # a token store written by tests.token_runs has no doc table
        (shutil.copytree if os.path.isdir(path) else shutil.copy)(path, os.path.join(dest, name))
    return dest


def assert_same_activations(run: str, reference: str) -> None:
    """Every stored activation object of `run` is byte-identical to `reference`'s."""
    objects, ref_objects = stored_objects(run), stored_objects(reference)
    objects.pop("activations/actx.json"), ref_objects.pop("activations/actx.json")
    assert objects.keys() == ref_objects.keys()
    differing = [k for k in objects if objects[k] != ref_objects[k]]
    assert not differing, f"objects differ from the reference run: {differing[:5]}"


def assert_close(actual: np.ndarray, expected: np.ndarray, rel: float, what: str) -> None:
    err = float(np.max(np.abs(actual.astype(np.float64) - expected)))
    scale = float(np.max(np.abs(expected)))
    assert err <= rel * scale, f"{what}: max|err| {err:.3g} > {rel} * max|ref| {scale:.3g}"


def assert_markers_record_the_tokens(run: str, names=("input_ids", "positions", "segment_ids")
                                     ) -> int:
    """Every commit marker of `run` records, per token array in `names`, the crc32c of each
    block of its partition's rows as the token store holds them (computed here with the
    crc32c library over the rows' little-endian bytes): what the worker computed on.
    Returns the markers checked."""
    import crc32c

    from actx.schemas import commit, store
    from tests import token_runs

    s = store.open_store(run)
    tokens = {name: token_runs.read_tokens(run, name) for name in names}
    checked = 0
    for pid in sorted(commit.committed_partitions(s)):
        marker = commit.read_marker(s, pid)
        assert marker.token_checksums is not None, f"partition {pid}: no token checksums"
        assert sorted(marker.token_checksums) == sorted(names), marker.token_checksums
        stop = marker.row_start + marker.row_count
        starts = range(marker.row_start, stop, marker.block_rows)
        for name, rows in tokens.items():
            want = [f"{crc32c.crc32c(rows[lo:min(stop, lo + marker.block_rows)].astype('<i4').tobytes()):08x}"
                    for lo in starts]
            assert marker.token_checksums[name] == want, (pid, name)
        checked += 1
    return checked
