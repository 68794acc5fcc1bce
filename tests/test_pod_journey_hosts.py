"""What the TPU hosts get: the wheel built from this machine's actx (a checkout, or a
pip-installed actx that has no setup.py), and the log copies `deploy.host_run` makes
(bounded, at most one write per object per second)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
import zipfile

from actx.deploy.detached import host_run
from actx.deploy.targets.tpu_vm import package as tpu_package
from actx.schemas import store as store_lib

REPO = pathlib.Path(__file__).resolve().parents[1]


def _run(cmd, **kwargs) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300,
                          **kwargs)
    assert proc.returncode == 0, f"{cmd}: {proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout


def _package_files(wheel: str) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as zf:
        return {n: zf.read(n) for n in zf.namelist()
                if n.split("/")[0] == tpu_package.PACKAGE}


def test_wheel_from_a_checkout_and_from_a_pip_installed_actx(tmp_path):
    before = sorted(os.listdir(REPO))
    wheel = tpu_package.build(str(tmp_path / "from-checkout"))
    assert os.path.basename(wheel) == tpu_package.wheel_name(tpu_package.package_version())
    assert sorted(os.listdir(REPO)) == before  # no dist/, build/ or egg-info in the checkout
    files = _package_files(wheel)
    for name in ("deploy/host_run.py", "workers/main.py", "schemas/version.py",
                 "deploy/demo.yaml", "__init__.py"):
        source = REPO / ("actx" if name == "__init__.py" else "") / name
        assert files[f"actx/{name}"] == source.read_bytes(), name
    # One import package, nothing else at the top level (issue 43).
    with zipfile.ZipFile(wheel) as zf:
        tops = {n.split("/")[0] for n in zf.namelist()}
    assert tops == {"actx", tpu_package.dist_info_dir(tpu_package.package_version())}, tops
    # Pure Python for the hosts' platform, whatever this machine built (actx.reader._row_copy).
    assert not [n for n in files if n.endswith((".so", ".pyd", ".dylib"))]

    # An actx installed from that wheel (no setup.py anywhere near it) builds its own.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv])
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _run([py, "-m", "pip", "install", "-q", "--no-deps", wheel], env=env)
    where = _run([py, "-c", "import actx.deploy; print(actx.deploy.__file__)"], cwd=tmp_path,
                 env=env)
    assert where.startswith(str(venv))
    out = _run([py, "-m", "actx.deploy.targets.tpu_vm.package", "--out", tmp_path / "from-install"],
               cwd=tmp_path, env=env).strip()
    assert out == str(tmp_path / "from-install" / os.path.basename(wheel))
    assert _package_files(out) == files
    with zipfile.ZipFile(out) as zf:
        info = tpu_package.dist_info_dir(tpu_package.package_version())
        metadata = zf.read(f"{info}/METADATA").decode()
        assert "Requires-Dist: jax>=0.6; extra == \"workers\"" in metadata
        assert zf.testzip() is None and f"{info}/RECORD" in zf.namelist()
    # ... and it installs (pip checks every file against RECORD).
    target = tmp_path / "reinstalled"
    _run([py, "-m", "pip", "install", "-q", "--no-deps", "--target", target, out], env=env)
    assert (target / "actx" / "deploy" / "host_run.py").read_bytes() == \
        files["actx/deploy/host_run.py"]


class _CountingStore:
    def __init__(self):
        self.writes: list[tuple[float, bytes]] = []

    def write(self, key: str, data: bytes) -> None:
        self.writes.append((time.monotonic(), data))


def test_host_log_copies_are_bounded_and_at_most_one_per_second(tmp_path):
    store = _CountingStore()
    log = tmp_path / "worker.log"
    shipper = host_run.LogShipper(store, "logs/j/h.log", str(log), every_s=0.0, max_bytes=100)
    lines = []
    t_end = time.monotonic() + 3.2
    with open(log, "w") as f:
        while time.monotonic() < t_end:
            lines.append(f"line {len(lines)}\n")
            f.write(lines[-1])
            f.flush()
            shipper.maybe_ship()
            time.sleep(0.02)
    assert not shipper.maybe_ship()  # within the second of the last copy
    assert shipper.maybe_ship(force=True)  # the last copy waits out that second
    times = [t for t, _ in store.writes]
    assert 4 <= len(times) <= 5 and all(b - a >= 1.0 for a, b in zip(times, times[1:]))
    text = "".join(lines).encode()
    last = store.writes[-1][1]
    assert last.endswith(text[-100:]) and len(text) > 100
    assert last.startswith(f"[actx: the first {len(text) - 100} bytes of this log".encode())
    assert not shipper.maybe_ship(force=True)  # nothing new: no write


def test_host_run_copies_the_log_and_records_the_exit(tmp_path):
    run = str(tmp_path / "run")
    os.makedirs(run)
    env = dict(os.environ, HOME=str(tmp_path), PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "actx.deploy.host_run", "--run", run, "--job", "j", "--host", "h0",
         "--log-every-s", "1", "--", sys.executable, "-c",
         "import sys, time; print('hello from the worker', flush=True); time.sleep(1.5); "
         "sys.exit(3)"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    data = store_lib.open_store(run).read(host_run.log_key("j", "h0"))
    assert data == b"hello from the worker\n[actx: worker exited with code 3]\n"


def test_wait_follows_the_run_until_its_partitions_commit_or_its_hosts_are_gone(tmp_path):
    """`submit --wait` reads the end of a detached job from the run directory: the job's
    hosts (named <slice>-w<i>, beating since it started) gone with partitions left is 1,
    the wanted partitions committed is 0; a heartbeat from before the job does not count."""
    import io

    from actx.deploy.targets.tpu_vm import follow as tpu_follow
    from actx.schemas import heartbeat as heartbeat_lib, layout
    from tests import token_runs

    run = str(tmp_path / "run")
    token_runs.write_token_run(run, "unused-model", n_rows=24, partition_rows=8)  # 3 parts
    s = store_lib.open_store(run)
    started = time.time()

    def beat(host: str, state: str, at: float, partition=None) -> None:
        hb = heartbeat_lib.Heartbeat(host=host, replica=0, process_index=0, state=state,
                                     attempt="a", updated_at=at, partition=partition)
        heartbeat_lib.HeartbeatWriter(s, host).beat(hb, force=True)

    beat("pod1-w2", "done", started - 100)  # an earlier job's host: not this job's
    s.create_json(layout.commit_key(0), {"partition": 0})
    beat("pod1-w0", "failed", started + 1, partition=1)
    beat("pod1-w1", "working", started - 30, partition=2)  # stale (older than 10 s)
    beat("other-w0", "working", time.time(), partition=2)  # another slice's host
    out = io.StringIO()
    assert tpu_follow.follow(run, "pod1-w", started - 60, out=out, every_s=0.1,
                             stale_after_s=10, start_timeout_s=5) == 1
    assert "the job's 2 host(s) stopped with 2 partition(s) without a commit" in out.getvalue()
    # Only partition 0 wanted (rerun --only 0): committed, so the job succeeded.
    assert tpu_follow.follow(run, "pod1-w", started, wanted=[0], out=io.StringIO(),
                             every_s=0.1) == 0
    # No host of this job ever reports: the wait ends after start_timeout_s.
    out = io.StringIO()
    assert tpu_follow.follow(run, "pod9-w", time.time(), out=out, every_s=0.1,
                             start_timeout_s=0.3) == 1
    assert "no worker of this job reported in 0.3 s" in out.getvalue()
