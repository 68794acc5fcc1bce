"""A worker aborted in native code ends its log with Python's thread stacks (faulthandler,
on in workers.main), after the native frames of absl's failed check: status's "its log
ends" names the fatal error and the line that says why, not the dump's last line. The log
is a real one: two `jax.distributed` processes, one of them stopped, and JAX's coordination
service ending the other for the heartbeats it stopped hearing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from actx.deploy import local
from actx.deploy.status import host_logs
from tests import worker_procs

PROCESS = """
import faulthandler, os, signal, sys, time
faulthandler.enable()  # as workers.main does
import jax
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2,
                           process_id=int(sys.argv[2]), heartbeat_timeout_seconds=3)
print("actx.worker up", flush=True)
if sys.argv[2] == "1":
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(60)
"""


def test_an_abort_by_jax_coordination_service_is_named_with_its_reason(tmp_path):
    coordinator = f"127.0.0.1:{worker_procs.free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    logs = [open(tmp_path / f"h{i}.log", "w") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", PROCESS, coordinator, str(i)], env=env,
                              stdout=logs[i], stderr=subprocess.STDOUT) for i in range(2)]
    try:
        assert procs[0].wait(timeout=120) == -signal.SIGABRT
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    text = (tmp_path / "h0.log").read_text()
    assert "Fatal Python error: Aborted" in text and "Thread 0x" in text, text
    assert host_logs.last_log_line(text, 400).startswith(
        "Fatal Python error: Aborted; before it: F"), text
    assert "Terminating process because the JAX distributed service detected fatal errors" \
        in host_logs.last_log_line(text, 400)
    # The local target reads the log file's end alike, past the dump.
    assert local.last_line_of_log_file(str(tmp_path / "h0.log"), 400) == \
        host_logs.last_log_line(text, 400)


def test_a_log_without_a_fatal_error_ends_with_its_last_line():
    text = ("2026-12-07 actx.worker extracting\n"
            "Traceback (most recent call last):\n"
            '  File "x.py", line 1, in <module>\n'
            "ValueError: bad\n"
            "[actx: the launcher's note]\n")
    assert host_logs.last_log_line(text) == "ValueError: bad"
    # A dump whose start the tail did not reach says so, not one of its frames.
    cut = '  File "x.py", line 3 in f\n\nExtension modules: numpy (total: 1)\n'
    assert host_logs.last_log_line(cut) == \
        "a fatal error's thread stacks (the error is further up the log)"
    # Lines shaped like a dump's, but not one: said as written.
    assert host_logs.last_log_line('File "/data/in.jsonl" is empty; skipped\n') == \
        'File "/data/in.jsonl" is empty; skipped'
    assert host_logs.last_log_line('Traceback (most recent call last):\n'
                                   '  File "a.py", line 3, in f\n') == 'File "a.py", line 3, in f'
    # absl's failed check without Python's dump: its fatal line, not a native frame.
    assert host_logs.last_log_line("extracting\nF1207 10:00:00.100 1 x.cc:1] Check failed: a\n"
                                   "*** Check failure stack trace: ***\n"
                                   "    @     0x7f01  foo()\n") == \
        "F1207 10:00:00.100 1 x.cc:1] Check failed: a"
    assert host_logs.last_log_line("Fatal Python error: Segmentation fault\n\n"
                                   "Current thread 0x1 (most recent call first):\n"
                                   '  File "x.py", line 3 in f\n') == \
        "Fatal Python error: Segmentation fault"
