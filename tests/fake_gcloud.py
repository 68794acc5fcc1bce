"""A simulated Cloud TPU for tests: a fake `gcloud` executable, its state in a directory.

Implements what actx runs: `compute tpus queued-resources create|describe|delete` and
`compute tpus tpu-vm create|describe|delete|scp|ssh`. Each host of a slice is a directory
on this machine with its own HOME and its own Python (a venv over this interpreter's
packages, so `pip install` of actx's wheel needs no network); `ssh` runs the command there
with bash, on every host at once for `--worker=all`, with what a TPU VM host offers: a
metadata server (`tests.fake_metadata`, on loopback; ACTX_TPU_METADATA_URL points at it)
answering agent-worker-number and worker-network-endpoints (every host is 127.0.0.1), and
a CPU "chip" count through XLA_FLAGS. The run directory is gs:// on fake-gcs-server, whose
endpoint the hosts inherit (in place of a service account).

Tests steer it with `FakeCloud`: fail a create, end a queued resource FAILED or SUSPENDED,
preempt a slice (SIGKILL every process its hosts started, state PREEMPTED). Every call is
logged (calls.jsonl), so a test can compare what ran with what `--dry-run` printed.

Run as a script: `python tests/fake_gcloud.py compute tpus ...` (FAKE_GCLOUD_STATE names
the state directory); `FakeCloud.install_shim` writes a `gcloud` wrapper first on PATH.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time

# The fake cloud's own table (independent of actx's): hosts and chips per host.
SLICES = {"v4-8": (1, 4), "v4-16": (2, 4), "v4-32": (4, 4), "v5litepod-8": (1, 8),
          "v5litepod-16": (4, 4), "v6e-8": (1, 8), "v6e-16": (4, 4)}
STATE_ENV = "FAKE_GCLOUD_STATE"
HOST_MARK_ENV = "FAKE_TPU_HOST"  # every process a host starts carries it: preemption kills them


class FakeCloud:
    """The simulator's state directory, and what tests do to it."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)

    # -- files ------------------------------------------------------------------------------
    def _path(self, name: str) -> str:
        return os.path.join(self.root, name)

    @contextlib.contextmanager
    def locked(self):
        """The state, read and written under a lock (gcloud calls run concurrently)."""
        with open(self._path("state.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = self.read()
            yield state
            tmp = self._path("state.json.tmp")
            with open(tmp, "w") as f:
                json.dump(state, f, indent=1, sort_keys=True)
            os.replace(tmp, self._path("state.json"))

    def read(self) -> dict:
        try:
            with open(self._path("state.json")) as f:
                return json.load(f)
        except FileNotFoundError:
            return {"queued": {}, "tpus": {}, "control": {}}

    def control(self, **settings) -> None:
        """fail_create: an error message for the next creates; qr_outcome: ACTIVE (default),
        FAILED or SUSPENDED; qr_waits: describes answered WAITING_FOR_RESOURCES first."""
        with self.locked() as state:
            state["control"].update(settings)

    def calls(self) -> list[list[str]]:
        try:
            with open(self._path("calls.jsonl")) as f:
                return [json.loads(line) for line in f]
        except FileNotFoundError:
            return []

    def install_shim(self, bin_dir: str, metadata_url: str) -> str:
        """Writes `gcloud` into bin_dir (put it first on PATH); returns its path."""
        os.makedirs(bin_dir, exist_ok=True)
        with open(self._path("metadata_url"), "w") as f:
            f.write(metadata_url)
        path = os.path.join(bin_dir, "gcloud")
        with open(path, "w") as f:
            f.write(f"#!/bin/sh\nexport {STATE_ENV}='{self.root}'\n"
                    f"exec '{sys.executable}' '{os.path.abspath(__file__)}' \"$@\"\n")
        os.chmod(path, 0o755)
        return path

    # -- hosts ------------------------------------------------------------------------------
    def host_home(self, tpu: str, i: int) -> str:
        return self._path(os.path.join("tpus", tpu, f"host-{i}"))

    def host_mark(self, tpu: str) -> str:
        return f"{self.root}:{tpu}:"

    def host_pids(self, tpu: str | None = None) -> list[int]:
        """Live processes started on the hosts (of `tpu`, or of every slice)."""
        mark = (f"{HOST_MARK_ENV}={self.host_mark(tpu)}" if tpu
                else f"{HOST_MARK_ENV}={self.root}:").encode()
        pids = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    env = f.read().split(b"\0")
                with open(f"/proc/{name}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                        continue  # a zombie is already dead
            except OSError:
                continue
            if any(e.startswith(mark) for e in env):
                pids.append(int(name))
        return pids

    def kill_hosts(self, tpu: str) -> int:
        """SIGKILLs every process of the slice's hosts (a host that loses power); returns
        how many there were."""
        killed = 0
        for _ in range(50):
            pids = self.host_pids(tpu)
            if not pids:
                return killed
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
            time.sleep(0.1)
        raise RuntimeError(f"processes of {tpu} survive SIGKILL: {self.host_pids(tpu)}")

    def preempt(self, tpu: str) -> int:
        """The slice is preempted: its hosts' processes die, the node is PREEMPTED and its
        queued resource SUSPENDED (what Cloud TPU shows for a spot slice taken back)."""
        with self.locked() as state:
            state["tpus"][tpu]["state"] = "PREEMPTED"
            for qr in state["queued"].values():
                if qr["node"] == tpu:
                    qr["state"] = "SUSPENDED"
        return self.kill_hosts(tpu)

    def _create_node(self, state: dict, name: str, accelerator_type: str) -> None:
        hosts, chips = SLICES[accelerator_type]
        state["tpus"][name] = {"state": "READY", "accelerator_type": accelerator_type,
                               "hosts": hosts, "chips_per_host": chips}
        for i in range(hosts):
            home = self.host_home(name, i)
            shutil.rmtree(home, ignore_errors=True)
            os.makedirs(home)
            # The host's Python: this interpreter's packages (the "image"), its own prefix
            # for what is pip-installed on it.
            subprocess.run([sys.executable, "-m", "venv", "--system-site-packages",
                            "--without-pip", os.path.join(home, "venv")], check=True)

    def _delete_node(self, state: dict, name: str) -> None:
        state["tpus"].pop(name, None)
        self.kill_hosts(name)
        shutil.rmtree(self._path(os.path.join("tpus", name)), ignore_errors=True)

    def host_env(self, tpu: dict, name: str, i: int) -> dict:
        from actx.deploy import local

        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("ACTX_", "FAKE_", "PYTHON", "VIRTUAL_ENV", "XLA_"))}
        home = self.host_home(name, i)
        with open(self._path("metadata_url")) as f:
            metadata = f.read().strip()
        # The fake gcloud's own directory leaves PATH: a host has no such shim.
        path = [p for p in env.get("PATH", "").split(os.pathsep)
                if not os.path.isfile(os.path.join(p, "gcloud"))
                or not open(os.path.join(p, "gcloud")).read().count(STATE_ENV)]
        env.update({
            "HOME": home, "PATH": os.pathsep.join([os.path.join(home, "venv", "bin"), *path]),
            "JAX_PLATFORMS": "cpu",
            # A chip a CPU device; the compile options the tests share (tests/conftest.py).
            "XLA_FLAGS": local.with_host_devices(os.environ.get("XLA_FLAGS", ""),
                                                 tpu["chips_per_host"]),
            "ACTX_TPU_METADATA_URL": f"{metadata}/{name}/{i}",
            HOST_MARK_ENV: f"{self.host_mark(name)}{i}",
            "PIP_NO_INDEX": "1",  # the image holds every dependency; the wheel comes by scp
        })
        return env


# -- the gcloud command line ------------------------------------------------------------------
class GcloudError(Exception):
    pass


def _parse(argv: list[str]) -> tuple[list[str], dict[str, str | bool]]:
    words, flags = [], {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            key, eq, value = a[2:].partition("=")
            if eq:
                flags[key] = value
            elif key in ("spot", "force", "quiet") or i + 1 == len(argv):
                flags[key] = True
            else:
                flags[key] = argv[i + 1]
                i += 1
        else:
            words.append(a)
        i += 1
    return words, flags


def _value(obj: dict, fmt: str | None) -> str:
    if not fmt:
        return json.dumps(obj, indent=1, sort_keys=True)
    if not (fmt.startswith("value(") and fmt.endswith(")")):
        raise GcloudError(f"this fake knows --format=value(...) only, not {fmt!r}")
    for part in fmt[6:-1].split("."):
        obj = obj.get(part, "") if isinstance(obj, dict) else ""
    return str(obj)


def _check_where(flags: dict) -> None:
    for key in ("zone", "project"):
        if not flags.get(key):
            raise GcloudError(f"argument --{key}: expected one argument")


def _create_check(cloud: FakeCloud, state: dict, accelerator_type) -> None:
    if state["control"].get("fail_create"):
        raise GcloudError(state["control"]["fail_create"])
    if accelerator_type not in SLICES:
        raise GcloudError(f"INVALID_ARGUMENT: accelerator type {accelerator_type!r} not found")


def queued_resources(cloud: FakeCloud, verb: str, name: str, flags: dict) -> int:
    with cloud.locked() as state:
        qr = state["queued"].get(name)
        if verb == "create":
            _create_check(cloud, state, flags.get("accelerator-type"))
            if qr is not None or name in state["tpus"]:
                raise GcloudError(f"ALREADY_EXISTS: queued resource {name} already exists")
            state["queued"][name] = {"state": {"state": "WAITING_FOR_RESOURCES"},
                                     "node": flags.get("node-id", name), "describes": 0,
                                     "accelerator_type": flags["accelerator-type"],
                                     "spot": bool(flags.get("spot"))}
            print(f"Create request issued for: [{name}]")
            return 0
        if qr is None:
            raise GcloudError(f"NOT_FOUND: queued resource {name} not found")
        if verb == "describe":
            qr["describes"] += 1
            st = qr["state"]
            if st["state"] == "WAITING_FOR_RESOURCES" and qr["describes"] > int(
                    state["control"].get("qr_waits", 1)):
                st["state"] = state["control"].get("qr_outcome", "ACTIVE")
                if st["state"] == "ACTIVE":
                    cloud._create_node(state, qr["node"], qr["accelerator_type"])
            print(_value({k: v for k, v in qr.items() if k != "describes"}, flags.get("format")))
            return 0
        if verb == "delete":
            if qr["node"] in state["tpus"]:
                if not flags.get("force"):
                    raise GcloudError(f"FAILED_PRECONDITION: queued resource {name} has a node; "
                                      f"use --force")
                cloud._delete_node(state, qr["node"])
            del state["queued"][name]
            print(f"Deleted queued resource [{name}].")
            return 0
    raise GcloudError(f"unknown queued-resources verb {verb!r}")


def tpu_vm(cloud: FakeCloud, verb: str, args: list[str], flags: dict) -> int:
    if verb == "scp":
        src, dest = args
        name, _, remote = dest.partition(":")
        tpu = _ready(cloud, name)
        workers = _workers(tpu, flags)
        for i in workers:
            shutil.copy(src, os.path.join(cloud.host_home(name, i), remote))
        return 0
    (name,) = args
    if verb == "create":
        with cloud.locked() as state:
            _create_check(cloud, state, flags.get("accelerator-type"))
            if name in state["tpus"]:
                raise GcloudError(f"ALREADY_EXISTS: TPU {name} already exists")
            cloud._create_node(state, name, flags["accelerator-type"])
        return 0
    if verb == "describe":
        tpu = cloud.read()["tpus"].get(name)
        if tpu is None:
            raise GcloudError(f"NOT_FOUND: TPU {name} not found")
        print(_value(tpu, flags.get("format")))
        return 0
    if verb == "delete":
        with cloud.locked() as state:
            if name not in state["tpus"]:
                raise GcloudError(f"NOT_FOUND: TPU {name} not found")
            cloud._delete_node(state, name)
        return 0
    if verb == "ssh":
        tpu = _ready(cloud, name)
        command = flags.get("command")
        if not isinstance(command, str):
            raise GcloudError("this fake runs --command only (no interactive shell)")
        procs = [subprocess.Popen(["bash", "-c", command], cwd=cloud.host_home(name, i),
                                  env=cloud.host_env(tpu, name, i))
                 for i in _workers(tpu, flags)]
        codes = [p.wait() for p in procs]
        return max(codes, key=abs)
    raise GcloudError(f"unknown tpu-vm verb {verb!r}")


def _ready(cloud: FakeCloud, name: str) -> dict:
    tpu = cloud.read()["tpus"].get(name)
    if tpu is None:
        raise GcloudError(f"NOT_FOUND: TPU {name} not found")
    if tpu["state"] != "READY":
        raise GcloudError(f"FAILED_PRECONDITION: TPU {name} is {tpu['state']}")
    return tpu


def _workers(tpu: dict, flags: dict) -> list[int]:
    worker = flags.get("worker", "0")
    if worker == "all":
        return list(range(tpu["hosts"]))
    ids = [int(w) for w in str(worker).split(",")]
    if any(not 0 <= w < tpu["hosts"] for w in ids):
        raise GcloudError(f"--worker={worker}: the TPU has workers 0..{tpu['hosts'] - 1}")
    return ids


def main(argv: list[str]) -> int:
    cloud = FakeCloud(os.environ[STATE_ENV])
    with open(cloud._path("calls.jsonl"), "a") as f:
        f.write(json.dumps(["gcloud", *argv]) + "\n")
    words, flags = _parse(argv)
    try:
        if words[:3] != ["compute", "tpus", "queued-resources"] and \
                words[:3] != ["compute", "tpus", "tpu-vm"]:
            raise GcloudError(f"this fake implements `compute tpus queued-resources|tpu-vm` "
                              f"only, not {' '.join(words)!r}")
        _check_where(flags)
        if words[2] == "queued-resources":
            return queued_resources(cloud, words[3], words[4], flags)
        return tpu_vm(cloud, words[3], words[4:], flags)
    except (GcloudError, IndexError, ValueError, KeyError) as e:
        what = ".".join(["gcloud", *words[:4]])
        print(f"ERROR: ({what}) {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
