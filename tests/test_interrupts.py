"""SIGINT and children killed by signals, through the real `actx` command line: every stage
exits 130 on SIGINT with one line and no traceback, an interrupted prepare run again
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

from deploy import commands
from schemas import store
from tests import hf_models

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(*args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.Popen([sys.executable, "-m", "deploy.cli", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _interrupt_when(proc: subprocess.Popen, started: str, timeout_s: float = 120) -> str:
    """Sends SIGINT once `started` appears on stderr; returns everything it printed."""
    said = []
    deadline = time.monotonic() + timeout_s
    for line in proc.stderr:
        said.append(line)
        if started in line:
            break
        assert time.monotonic() < deadline, "".join(said)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=timeout_s)
    return "".join(said) + err + out


def _one_interrupted_line(proc, said: str, command: str) -> None:
    assert proc.returncode == 130, said
    assert "Traceback" not in said, said
    assert [line for line in said.splitlines() if "interrupted" in line][0].startswith(
        f"actx {command}: interrupted"), said


def _token_objects(run: str) -> dict:
    s = store.open_store(run)
    return {k: s.read(k) for k in s.list("tokens/")}


def test_sigint_during_prepare_exits_130_and_a_rerun_is_byte_identical(tmp_path,
                                                                       qwen_tokenizer_dir):
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": f"words of document {i} " * 20}) + "\n"
                            for i in range(10000)))
    run = str(tmp_path / "run")
    argv = ["prepare", "--out", run, "--tokenizer", qwen_tokenizer_dir, "--text", str(data),
            "--seq-len", "256", "--partition-rows", "512", "--rows-per-shard", "64",
            "--runner=FnApiRunner"]
    proc = _start(*argv)
    said = _interrupt_when(proc, "prepare: 1 file(s)")
    _one_interrupted_line(proc, said, "prepare")
    assert "is not prepared (no manifest.json)" in said
    assert not os.path.exists(os.path.join(run, "manifest.json"))

    again = _start(*argv)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, out + err
    fresh = _start(*[str(tmp_path / "fresh") if a == run else a for a in argv])
    out, err = fresh.communicate(timeout=300)
    assert fresh.returncode == 0, out + err
    assert _token_objects(run) == _token_objects(str(tmp_path / "fresh"))


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, qwen_tokenizer_dir) -> str:
    t = tmp_path_factory.mktemp("small")
    model = hf_models.make_tiny_checkpoint(t / "m", "qwen2", vocab_size=151936,
                                           num_hidden_layers=2)
    data = t / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " * 30}) + "\n"
                            for i in range(4000)))
    run = str(t / "run")
    proc = _start("prepare", "--out", run, "--tokenizer", qwen_tokenizer_dir, "--model",
                  model, "--text", str(data), "--seq-len", "32", "--partition-rows", "4",
                  "--rows-per-shard", "2", "--runner=FnApiRunner")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    return run


@pytest.mark.parametrize("when", ["starting", "extracting"])
def test_sigint_during_extract_exits_130(small_run, when):
    proc = _start("extract", "--run", small_run, "--batch-size", "8")
    if when == "starting":  # JAX starts, the model loads
        time.sleep(1.5)
    else:  # its heartbeat says working (earlier attempts left theirs): the loop runs
        deadline = time.monotonic() + 120
        s = store.open_store(small_run)
        while not any(f"-{proc.pid}-" in beat.get("attempt", "")
                      and beat.get("state") == "working"
                      for beat in (s.read_json(k) or {} for k in s.list("workers/"))):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    said = out + err
    _one_interrupted_line(proc, said, "extract")
    assert f"`actx rerun {small_run}` finishes them" in said


def test_sigint_during_status_watch_exits_130(small_run):
    proc = _start("status", small_run, "--watch", "1")
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    _one_interrupted_line(proc, out + err, "status")


def test_a_child_killed_by_a_signal_is_not_a_negative_exit_status():
    out = io.StringIO()
    code = commands.execute([commands.Command(("sh", "-c", "kill -9 $$"), "die by SIGKILL")],
                            out=out)
    assert code == 128 + 9, out.getvalue()
    assert commands.describe_exit(-9) == "killed by SIGKILL"
    assert commands.exit_status(-2) == 130 and commands.exit_status(3) == 3
