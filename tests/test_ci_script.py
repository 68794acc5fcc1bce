""".ci/run's exit status is its commands' own, whatever its EXIT trap meets.

A CI whose every test passed once exited 127: the trap's `wait` for the background setup,
which the script had already waited for, answered 127 (bash forgets a reaped pid in POSIX
mode, and any bash once the pid is reused), and errexit holds inside a trap. Here the trap
is taken from .ci/run as written and run in the script's own shell options, in POSIX mode,
after the same `wait`."""

from __future__ import annotations

import pathlib
import re
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[1]


def _exit_trap() -> str:
    """The `trap '...' EXIT` statement of .ci/run, continuation lines and all."""
    text = (REPO / ".ci" / "run").read_text()
    m = re.search(r"^trap '.*?' EXIT$", text, re.S | re.M)
    assert m, ".ci/run has no EXIT trap"
    return m.group(0)


def _run(last_command: str, tmp_path: pathlib.Path) -> int:
    script = tmp_path / "ci.sh"
    script.write_text("\n".join([
        "set -euo pipefail",
        'sudo=""',
        f'system_done="{tmp_path}/done"; mkdir -p "$system_done"',
        "(true) & system_pid=$!",
        _exit_trap(),
        'wait "$system_pid" || true',
        last_command,
        "",
    ]))
    env = {"PATH": "/usr/bin:/bin", "POSIXLY_CORRECT": "1"}
    return subprocess.run(["bash", str(script)], env=env, cwd=REPO, timeout=30).returncode


def test_a_passing_ci_exits_0_though_the_trap_waits_for_a_reaped_pid(tmp_path):
    assert _run("echo done", tmp_path) == 0


def test_a_failing_ci_keeps_its_own_status(tmp_path):
    assert _run("exit 3", tmp_path) == 3
