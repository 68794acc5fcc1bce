"""A full disk and a read-only run directory, for real: each command runs in its own mount
namespace (`unshare -m`) over a tiny tmpfs or a read-only bind mount, so nothing outside
the test sees them. One line names the path and what to do, exit 2, no traceback, no
temporary file left; `verify` prints its report even when it cannot record it."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _private_mounts_work() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=8k tmpfs "
                            "/mnt 2>/dev/null || mount -t tmpfs -o size=8k tmpfs /tmp"],
                           capture_output=True)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _private_mounts_work(),
                                reason="needs unshare -m and mount (root in a container)")


def _actx_with_mount(mount: str, *args) -> subprocess.CompletedProcess:
    """`actx ARGS` after `mount` ran, both inside one private mount namespace."""
    command = (f"{mount} && exec {shlex.quote(sys.executable)} -m actx.deploy.cli "
               + " ".join(shlex.quote(a) for a in args))
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run(["unshare", "-m", "sh", "-c", command], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def _read_only(path: str) -> str:
    q = shlex.quote(path)
    return f"mount --bind {q} {q} && mount -o remount,bind,ro {q}"


def _texts(tmp_path, n: int) -> str:
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} " * 30}) + "\n"
                            for i in range(n)))
    return str(path)


def _one_line(proc, *expected) -> str:
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in said, said
    lines = [line for line in said.splitlines() if "error:" in line]
    assert len(lines) == 1, said
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def _temporary_files(root) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files
            if ".tmp-" in f]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, qwen_tokenizer_dir) -> str:
    t = tmp_path_factory.mktemp("prepared")
    run = str(t / "run")
    proc = subprocess.run(
        [sys.executable, "-m", "actx.deploy.cli", "prepare", "--out", run, "--tokenizer",
         qwen_tokenizer_dir, "--text", _texts(t, 20), "--seq-len", "32", "--runner=FnApiRunner"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run


@pytest.mark.parametrize("size,where", [("200k", ""), ("4m", "tokens/")])
def test_prepare_onto_a_full_disk(tmp_path, qwen_tokenizer_dir, size, where):
    """Full at the first work unit's tokens (200k), or while the token arrays are written
    (4m: tensorstore's RESOURCE_EXHAUSTED, which came as its raw text after a traceback)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = _actx_with_mount(f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(disk))}",
                            "prepare", "--out", str(disk / "run"), "--tokenizer",
                            qwen_tokenizer_dir, "--text", _texts(tmp_path, 4000), "--seq-len",
                            "32", "--runner=FnApiRunner")
    line = _one_line(proc, f"{disk}/run/{where}", "cannot write (No space left on device); the disk "
                     "is full: free space, or choose a run directory on another disk, then "
                     "run the same command again")
    assert line.startswith("actx prepare: error: ")


def test_prepare_into_a_read_only_directory(tmp_path, qwen_tokenizer_dir):
    out = tmp_path / "ro"
    out.mkdir()
    proc = _actx_with_mount(_read_only(str(out)), "prepare", "--out", str(out / "run"),
                            "--tokenizer", qwen_tokenizer_dir, "--text", _texts(tmp_path, 5),
                            "--runner=FnApiRunner")
    _one_line(proc, f"{out}/run/", "cannot write (Read-only file system); the file system is "
              "read-only: choose a writable run directory")
    assert not os.listdir(out)


def test_verify_and_status_of_a_read_only_run(prepared):
    before = sorted(os.listdir(prepared))
    proc = _actx_with_mount(_read_only(prepared), "verify", prepared)
    # The report (nothing committed yet: INCOMPLETE, exit 1), then why it was not recorded.
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "INCOMPLETE: 2 partition(s) not committed" in proc.stdout
    assert proc.stderr.strip() == (
        f"actx verify: the report above was not recorded: {prepared}/verify/latest.json: "
        f"cannot write (Read-only file system); the file system is read-only: choose a "
        f"writable run directory, then run the same command again")
    proc = _actx_with_mount(_read_only(prepared), "status", prepared)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert sorted(os.listdir(prepared)) == before and not _temporary_files(prepared)
