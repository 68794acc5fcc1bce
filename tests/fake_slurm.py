"""A simulated Slurm cluster for tests: fake `sbatch`, `srun`, `squeue`, `scancel` and
`sacct` executables, their state in a directory, every "node" a process group here.

It does what Slurm's documentation says of the calls actx makes:
- `sbatch [--parsable] --array=0-N --nodes=K --job-name=NAME --output=PATTERN ... SCRIPT`
  prints the job id and starts every array task at once (no queue wait), each running
  SCRIPT with bash under the task's environment: SLURM_JOB_ID (the task's own),
  SLURM_ARRAY_JOB_ID, SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_COUNT, SLURM_JOB_NAME,
  SLURM_JOB_NUM_NODES / SLURM_NNODES and SLURM_JOB_NODELIST, a hostlist of K loopback
  addresses of its own ("127.1.<task>.[1-K]", so a coordinator on the first node is
  reachable), its output in PATTERN (%x name, %A array job, %a task, %j job). The other
  flags (partition, account, gres, time, ...) are recorded and accepted.
- `srun [--kill-on-bad-exit=1] [--ntasks-per-node=1] CMD...` inside a task: one process
  per node, each in its own process group (a node), with SLURM_PROCID, SLURM_NTASKS,
  SLURM_NODEID, SLURM_LOCALID, SLURM_STEP_ID, SLURM_STEP_NODELIST and SLURMD_NODENAME;
  with --kill-on-bad-exit a task that fails ends the step's other tasks (SIGTERM, then
  SIGKILL after KillWait); SIGTERM to srun goes to every task the same way.
- `squeue --noheader [--name=N] [--user=U] [-j ID] --format="%i %T"`: pending or running
  tasks ("<array job>_<task> RUNNING").
- `scancel [--name=N] [--user=U] [ID...]`: SIGTERM to the tasks' batch scripts (srun
  passes it on); the tasks end CANCELLED.
- `sacct -j ID --noheader --parsable2 --format=JobID,State,ExitCode`.

Tests steer it with `FakeSlurm`: `kill_node` SIGKILLs one node's processes (the node
dies: its step fails, the task ends NODE_FAIL). Every call is logged (calls.jsonl).
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import json
import os
import signal
import subprocess
import sys
import time

STATE_ENV = "FAKE_SLURM_STATE"
KILL_WAIT_S = 3.0
VERBS = ("sbatch", "srun", "squeue", "scancel", "sacct")


class FakeSlurm:
    """The simulator's state directory, and what tests do to it."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name)

    @contextlib.contextmanager
    def locked(self):
        with open(self._path("state.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = self.read()
            yield state
            with open(self._path("state.json.tmp"), "w") as f:
                json.dump(state, f, indent=1, sort_keys=True)
            os.replace(self._path("state.json.tmp"), self._path("state.json"))

    def read(self) -> dict:
        try:
            with open(self._path("state.json")) as f:
                return json.load(f)
        except FileNotFoundError:
            return {"next_id": 1000, "jobs": {}}

    def log_call(self, argv: list[str]) -> None:
        with open(self._path("calls.jsonl"), "a") as f:
            f.write(json.dumps(argv) + "\n")

    def calls(self) -> list[list[str]]:
        try:
            with open(self._path("calls.jsonl")) as f:
                return [json.loads(line) for line in f]
        except FileNotFoundError:
            return []

    def install(self, bin_dir: str) -> None:
        """Writes the five executables into bin_dir (put it first on PATH)."""
        os.makedirs(bin_dir, exist_ok=True)
        for verb in VERBS:
            path = os.path.join(bin_dir, verb)
            with open(path, "w") as f:
                f.write(f"#!/bin/sh\nexport {STATE_ENV}='{self.root}'\n"
                        f"exec '{sys.executable}' '{os.path.abspath(__file__)}' {verb} \"$@\"\n")
            os.chmod(path, 0o755)

    # -- what tests do ----------------------------------------------------------------------
    def tasks(self) -> dict[str, dict]:
        """{"<job>_<task>": its record} of every job."""
        return {f"{j}_{t}": task for j, job in self.read()["jobs"].items()
                for t, task in job["tasks"].items()}

    def wait_node_pids(self, key: str, nodes: int, timeout: float = 60.0) -> list[int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = self.tasks().get(key, {}).get("nodes", {})
            if len(pids) == nodes:
                return [pids[str(r)] for r in range(nodes)]
            time.sleep(0.1)
        raise AssertionError(f"task {key} did not start {nodes} node(s)")

    def kill_node(self, key: str, rank: int) -> None:
        """The node of `rank` in task `key` dies: every process it runs gets SIGKILL."""
        with self.locked() as state:
            job, task = key.split("_")
            record = state["jobs"][job]["tasks"][task]
            record["node_failed"] = True
            pid = record["nodes"][str(rank)]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)

    def live_pids(self) -> list[int]:
        """Processes of every node, and of every task not yet ended, still running (an
        ended task's own process exits right after it records the end)."""
        pids = []
        for task in self.tasks().values():
            pids += list(task.get("nodes", {}).values())
            if task["state"] in ("PENDING", "RUNNING"):
                pids.append(task.get("pid"))
        return [p for p in pids if p and _alive(p)]

    def kill_all(self) -> None:
        for pid in self.live_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _flags(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Long options (--k=v, --k v for the ones that take a value, bare switches) up to the
    first operand; the rest."""
    flags, i = {}, 0
    while i < len(argv) and argv[i].startswith("-"):
        key, eq, value = argv[i].lstrip("-").partition("=")
        if not eq and key in ("j", "jobs", "name", "user", "format", "o", "output"):
            i, value = i + 1, argv[i + 1]
        flags[key] = value if (eq or key in ("j", "jobs", "name", "user", "format", "o",
                                             "output")) else "1"
        i += 1
    return flags, argv[i:]


def sbatch(sim: FakeSlurm, argv: list[str]) -> int:
    flags, rest = _flags(argv)
    if len(rest) != 1 or not os.path.isfile(rest[0]):
        print("sbatch: error: give one batch script", file=sys.stderr)
        return 1
    lo, _, hi = flags.get("array", "0-0").partition("-")
    tasks = range(int(lo), int(hi or lo) + 1)
    with sim.locked() as state:
        job = str(state["next_id"])
        state["next_id"] += len(tasks) + 1
        state["jobs"][job] = {
            "name": flags.get("job-name", os.path.basename(rest[0])), "user": getpass.getuser(),
            "nodes": int(flags.get("nodes", 1)), "flags": flags, "script": rest[0],
            "tasks": {str(t): {"state": "PENDING", "nodes": {}} for t in tasks}}
    for t in tasks:  # the task outlives sbatch, as a batch job outlives its submitter
        subprocess.Popen([sys.executable, os.path.abspath(__file__), "_task", job, str(t)],
                         env={**os.environ, STATE_ENV: sim.root}, start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    print(job if "parsable" in flags else f"Submitted batch job {job}", flush=True)
    return 0


def _task(sim: FakeSlurm, job: str, task: str) -> int:
    """One array task: its batch script under bash, then its end state."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # scancel's SIGTERM is for the script
    record = sim.read()["jobs"][job]
    nodes, name = record["nodes"], record["name"]
    task_id = str(int(job) + 1 + int(task))
    nodelist = f"127.1.{task}.[1-{nodes}]" if nodes > 1 else f"127.1.{task}.1"
    out = (record["flags"].get("output") or "slurm-%A_%a.out").replace("%x", name).replace(
        "%A", job).replace("%a", task).replace("%j", task_id)
    env = {**os.environ, "SLURM_JOB_ID": task_id, "SLURM_ARRAY_JOB_ID": job,
           "SLURM_ARRAY_TASK_ID": task, "SLURM_ARRAY_TASK_COUNT": str(len(record["tasks"])),
           "SLURM_JOB_NAME": name, "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes),
           "SLURM_JOB_NODELIST": nodelist, "FAKE_SLURM_TASK": f"{job}_{task}"}
    with open(out, "ab") as f:
        proc = subprocess.Popen(["bash", record["script"]], env=env, stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=lambda: signal.signal(signal.SIGTERM,
                                                                 signal.SIG_DFL))
        with sim.locked() as state:
            state["jobs"][job]["tasks"][task].update(state="RUNNING", pid=os.getpid())
        rc = proc.wait()
    # COMPLETING: the task ends when its nodes' processes have (srun's KillWait).
    deadline = time.monotonic() + KILL_WAIT_S + 5
    while time.monotonic() < deadline and any(
            _alive(p) for p in sim.read()["jobs"][job]["tasks"][task]["nodes"].values()):
        time.sleep(0.1)
    with sim.locked() as state:
        rec = state["jobs"][job]["tasks"][task]
        rec["state"] = ("CANCELLED" if rec.get("cancelled") else "NODE_FAIL"
                        if rec.get("node_failed") else "COMPLETED" if rc == 0 else "FAILED")
        rec["exit_code"] = rc
    return 0


def srun(sim: FakeSlurm, argv: list[str]) -> int:
    flags, cmd = _flags(argv)
    key = os.environ.get("FAKE_SLURM_TASK")
    if not key or not cmd:
        print("srun: error: no job allocation (run inside sbatch) or no command",
              file=sys.stderr)
        return 1
    job, task = key.split("_")
    nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
    nodelist = os.environ["SLURM_JOB_NODELIST"]
    prefix = nodelist.split("[")[0]
    procs = []
    for rank in range(nodes):
        host = f"{prefix}{rank + 1}" if "[" in nodelist else nodelist
        env = {**os.environ, "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(nodes),
               "SLURM_NODEID": str(rank), "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0",
               "SLURM_STEP_NODELIST": nodelist, "SLURMD_NODENAME": host}
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    with sim.locked() as state:
        state["jobs"][job]["tasks"][task]["nodes"] = {str(r): p.pid for r, p in enumerate(procs)}

    def end_all(*_):
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)

    signal.signal(signal.SIGTERM, lambda *_: (end_all(), sys.exit(143)))
    while any(p.poll() is None for p in procs):
        if flags.get("kill-on-bad-exit") == "1" and any(p.poll() not in (None, 0)
                                                         for p in procs):
            bad = next(p for p in procs if p.poll() not in (None, 0))
            print(f"srun: error: task {procs.index(bad)} exited with {bad.returncode}; "
                  f"terminating the step", file=sys.stderr, flush=True)
            end_all()
        time.sleep(0.2)
    codes = [p.returncode for p in procs]
    return next((c if c > 0 else 128 - c for c in codes if c != 0), 0)


def _matching(state: dict, flags: dict, ids: list[str]):
    for job, rec in state["jobs"].items():
        if flags.get("name") and rec["name"] != flags["name"]:
            continue
        if flags.get("user") and rec["user"] != flags["user"]:
            continue
        wanted = ids + ([flags["j"]] if flags.get("j") else [])
        if wanted and job not in wanted:
            continue
        for task, t in rec["tasks"].items():
            yield job, task, t


def squeue(sim: FakeSlurm, argv: list[str]) -> int:
    flags, ids = _flags(argv)
    for job, task, t in _matching(sim.read(), flags, ids):
        if t["state"] in ("PENDING", "RUNNING"):
            print(flags.get("format", "%i %T").replace("%i", f"{job}_{task}").replace(
                "%T", t["state"]))
    return 0


def scancel(sim: FakeSlurm, argv: list[str]) -> int:
    flags, ids = _flags(argv)
    pids = []
    with sim.locked() as state:
        for job, task, t in _matching(state, flags, ids):
            if t["state"] in ("PENDING", "RUNNING"):
                t["cancelled"] = True
                pids.append(t.get("pid"))
    for pid in filter(None, pids):  # the batch script and srun; srun passes it on
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
    return 0


def sacct(sim: FakeSlurm, argv: list[str]) -> int:
    flags, ids = _flags(argv)
    for job, task, t in _matching(sim.read(), flags, ids):
        print(f"{job}_{task}|{t['state']}|{t.get('exit_code', 0)}:0")
    return 0


def main(argv: list[str]) -> int:
    sim = FakeSlurm(os.environ[STATE_ENV])
    verb, args = argv[0], argv[1:]
    if verb != "_task":
        sim.log_call([verb, *args])
    if verb == "_task":
        return _task(sim, *args)
    return {"sbatch": sbatch, "srun": srun, "squeue": squeue, "scancel": scancel,
            "sacct": sacct}[verb](sim, args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
