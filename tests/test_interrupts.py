"""SIGINT, SIGTERM and children killed by signals, through the real `actx` command line:
every stage exits 130 on SIGINT and 143 on SIGTERM with one line naming what to do and no
traceback, leaves no temporary file, an interrupted prepare, submit or rerun run again
finishes byte-identical to an uninterrupted one, and an exit status is never a child's
negative signal number passed through (247 for SIGKILL)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from actx.deploy import commands
from actx.schemas import store
from tests import hf_models

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(*args) -> subprocess.Popen:
    # faulthandler: a process that hangs instead of stopping is sent SIGABRT and prints
    # every thread's stack, so a failure says where it hung
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONFAULTHANDLER": "1"}
    return subprocess.Popen([sys.executable, "-m", "actx.deploy.cli", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


SIGNALS = pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM],
                                  ids=["SIGINT", "SIGTERM"])


def _catches(proc: subprocess.Popen, sig: int, timeout_s: float = 60) -> None:
    """Waits until the process has a handler for `sig` (its SigCgt mask in /proc). For
    SIGTERM that is actx's (installed for both stop signals at once); a signal sent
    earlier, while Python imports actx, would meet Python's defaults."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with open(f"/proc/{proc.pid}/status") as f:
            caught = int(next(l for l in f if l.startswith("SigCgt:")).split()[1], 16)
        if caught >> (sig - 1) & 1:
            return
        time.sleep(0.02)
    raise AssertionError(f"the process never caught signal {sig}")


def _interrupt_when(proc: subprocess.Popen, started: str, timeout_s: float = 120,
                    sig: int = signal.SIGINT) -> str:
    """Sends `sig` once `started` appears on stderr; returns everything it printed."""
    said = []
    deadline = time.monotonic() + timeout_s
    for line in proc.stderr:
        said.append(line)
        if started in line:
            break
        assert time.monotonic() < deadline, "".join(said)
    time.sleep(1.0)
    proc.send_signal(sig)
    out, err = _communicate(proc, timeout_s)
    return "".join(said) + err + out


def _communicate(proc: subprocess.Popen, timeout_s: float) -> tuple[str, str]:
    """proc.communicate, but a process still running after `timeout_s` fails the test
    with its threads' stacks (faulthandler's, on SIGABRT)."""
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        out, err = proc.communicate(timeout=60)
        raise AssertionError(f"still running {timeout_s} s after the stop signal:\n"
                             f"{out}{err}") from None


def _one_interrupted_line(proc, said: str, command: str, sig: int = signal.SIGINT) -> str:
    assert proc.returncode == 128 + sig, said
    assert "Traceback" not in said, said
    line = [line for line in said.splitlines() if "interrupted" in line][0]
    assert line.startswith(f"actx {command}: interrupted by {signal.Signals(sig).name}"), said
    return line


def _temporary_files(root) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files
            if ".tmp-" in f]


def _token_objects(run: str) -> dict:
    s = store.open_store(run)
    return {k: s.read(k) for k in s.list("tokens/")}


def _prepare_argv(data, tokenizer: str, run: str) -> list[str]:
    return ["prepare", "--out", run, "--tokenizer", tokenizer, "--text", str(data),
            "--seq-len", "256", "--partition-rows", "512", "--rows-per-shard", "64",
            "--runner=FnApiRunner"]


@pytest.fixture(scope="module")
def prepare_inputs(tmp_path_factory, qwen_tokenizer_dir) -> tuple[str, dict]:
    """10k documents (a prepare long enough to stop half way) and the token objects an
    uninterrupted prepare of them stores: the reference of both signals' cases."""
    t = tmp_path_factory.mktemp("prepare_inputs")
    data = t / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": f"words of document {i} " * 20}) + "\n"
                            for i in range(10000)))
    fresh = _start(*_prepare_argv(data, qwen_tokenizer_dir, str(t / "fresh")))
    out, err = fresh.communicate(timeout=300)
    assert fresh.returncode == 0, out + err
    return str(data), _token_objects(str(t / "fresh"))


@SIGNALS
def test_stop_signal_during_prepare_and_a_rerun_is_byte_identical(sig, tmp_path,
                                                                  qwen_tokenizer_dir,
                                                                  prepare_inputs):
    data, reference = prepare_inputs
    run = str(tmp_path / "run")
    argv = _prepare_argv(data, qwen_tokenizer_dir, run)
    proc = _start(*argv)
    said = _interrupt_when(proc, "prepare: 1 file(s)", sig=sig)
    _one_interrupted_line(proc, said, "prepare", sig)
    assert "is not prepared (no manifest.json)" in said
    assert not os.path.exists(os.path.join(run, "manifest.json"))
    assert not _temporary_files(run)

    again = _start(*argv)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, out + err
    assert _token_objects(run) == reference


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, qwen_tokenizer_dir) -> str:
    t = tmp_path_factory.mktemp("small")
    model = hf_models.make_tiny_checkpoint(t / "m", "qwen2", vocab_size=151936,
                                           num_hidden_layers=2)
    data = t / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " * 30}) + "\n"
                            for i in range(1500)))
    run = str(t / "run")
    proc = _start("prepare", "--out", run, "--tokenizer", qwen_tokenizer_dir, "--model",
                  model, "--text", str(data), "--seq-len", "32", "--partition-rows", "4",
                  "--rows-per-shard", "2", "--runner=FnApiRunner")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    return run


@SIGNALS
@pytest.mark.parametrize("when", ["starting", "extracting"])
def test_stop_signal_during_extract(small_run, when, sig):
    proc = _start("extract", "--run", small_run, "--batch-size", "8")
    if when == "starting":  # JAX starts, the model loads
        _catches(proc, signal.SIGTERM)  # actx's handlers (Python has its own for SIGINT)
        time.sleep(0.5)
    else:  # its heartbeat says working (earlier attempts left theirs): the loop runs
        deadline = time.monotonic() + 120
        s = store.open_store(small_run)
        while not any(f"-{proc.pid}-" in beat.get("attempt", "")
                      and beat.get("state") == "working"
                      for beat in (s.read_json(k) or {} for k in s.list("workers/"))):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
    proc.send_signal(sig)
    out, err = _communicate(proc, 120)
    said = out + err
    _one_interrupted_line(proc, said, "extract", sig)
    assert f"`actx rerun {small_run}` finishes them" in said
    assert not _temporary_files(small_run)


@SIGNALS
def test_stop_signal_during_status_watch(small_run, sig):
    proc = _start("status", small_run, "--watch", "1")
    time.sleep(3)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    _one_interrupted_line(proc, out + err, "status", sig)


def _submit_config(tmp_path, model: str, tokenizer: str, run: str) -> str:
    import yaml

    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": f"document {i} " * 12}) + "\n"
                             for i in range(80)))
    path = tmp_path / f"{os.path.basename(run)}.yaml"
    path.write_text(yaml.safe_dump({
        "run": run,
        "spec": {"name": "stop", "model": {"path": model}, "tokenizer": {"path": tokenizer},
                 "sources": [{"kind": "text", "paths": [str(texts)]}],
                 "packing": {"seq_len": 32},
                 "layout": {"rows_per_shard": 2, "partition_rows": 4},
                 "capture": {"hooks": "layers.0.resid_post"}},
        "target": {"kind": "local", "hosts": 2, "batch_size": 4, "heartbeat_s": 1}}))
    return str(path)


def test_sigterm_during_submit_stops_its_workers_and_rerun_is_byte_identical(
        tmp_path, qwen_tokenizer_dir):
    """SIGTERM to `actx submit` while its 2 workers extract: the workers stop at a step
    boundary (committing only whole partitions), submit exits 143 naming the rerun, no
    worker process or temporary file is left, and `actx rerun` ends with the bytes of an
    uninterrupted submit."""
    from tests import worker_procs

    model = hf_models.make_tiny_checkpoint(tmp_path / "m", "qwen2", vocab_size=151936,
                                           num_hidden_layers=1)
    ref, run = str(tmp_path / "ref"), str(tmp_path / "run")
    done = subprocess.run([sys.executable, "-m", "actx.deploy.cli", "submit",
                           _submit_config(tmp_path, model, qwen_tokenizer_dir, ref)],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    config = _submit_config(tmp_path, model, qwen_tokenizer_dir, run)
    proc = _start("submit", config)
    deadline = time.monotonic() + 300
    while not (os.path.isdir(os.path.join(run, "commits")) and os.listdir(
            os.path.join(run, "commits"))):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    workers = [int(p) for p in os.listdir("/proc") if p.isdigit() and _child_of(int(p), proc.pid)]
    proc.send_signal(signal.SIGTERM)
    out, err = _communicate(proc, 120)
    line = _one_interrupted_line(proc, out + err, "submit", signal.SIGTERM)
    assert f"stay uncommitted: `actx submit {config}` again finishes them" in line, line
    assert workers and not any(os.path.exists(f"/proc/{w}") for w in workers), workers
    assert not _temporary_files(run)
    committed = len(os.listdir(os.path.join(run, "commits")))
    manifest = json.load(open(os.path.join(run, "manifest.json")))
    assert committed < len(manifest["partitions"]["tokens"]), "nothing was left to interrupt"
    again = _start("submit", config)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, out + err
    assert "is already prepared" in out
    worker_procs.assert_same_activations(run, ref)


def _child_of(pid: int, parent: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == parent
    except (OSError, ValueError, IndexError):
        return False


def test_sigterm_during_verify(small_run):
    """verify records its report only at the end: a stop signal leaves no record, and one
    line says how to check again."""
    proc = _start("verify", small_run)
    _catches(proc, signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    line = _one_interrupted_line(proc, out + err, "verify", signal.SIGTERM)
    assert f"`actx verify {small_run}` checks it again" in line
    assert not os.path.exists(os.path.join(small_run, "verify"))


def test_a_child_killed_by_a_signal_is_not_a_negative_exit_status():
    out = io.StringIO()
    code = commands.execute([commands.Command(("sh", "-c", "kill -9 $$"), "die by SIGKILL")],
                            out=out)
    assert code == 128 + 9, out.getvalue()
    assert commands.describe_exit(-9) == "killed by SIGKILL"
    assert commands.exit_status(-2) == 130 and commands.exit_status(3) == 3
