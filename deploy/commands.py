"""Shell commands as data: what remote targets run, printed exactly by `--dry-run`.

A plan is a list of `Command`s; executing a plan runs each in order and stops at the
first failure. Remote targets (TPU VMs, Dataflow) are driven only through such commands,
so a dry run shows every byte that would be sent.
"""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys
import time


@dataclasses.dataclass(frozen=True)
class Command:
    """argv: the exact argument vector. what: one line saying why it runs.
    cwd: working directory (None: the current one).
    poll_until: for a status query, repeat it until its output equals this value.
    poll_fail: outputs of the status query that end the wait as a failure.
    poll_timeout_s: the wait fails after this long.
    in_process: run by actx itself (e.g. prepare); argv is the equivalent command line.
    may_fail: a failure is reported and the plan goes on (e.g. deleting what may be gone).
    on_fail: what to do about a failure of this step, printed with it.
    """

    argv: tuple[str, ...]
    what: str
    cwd: str | None = None
    poll_until: str | None = None
    poll_fail: tuple[str, ...] = ()
    poll_timeout_s: float | None = None
    in_process: bool = False
    may_fail: bool = False
    on_fail: str | None = None

    def shell(self) -> str:
        line = shlex.join(self.argv)
        return f"(cd {shlex.quote(self.cwd)} && {line})" if self.cwd else line


def render_plan(plan: list[Command]) -> str:
    lines = []
    for i, cmd in enumerate(plan, 1):
        note = ""
        if cmd.poll_until:
            stops = [f"fail on {'/'.join(cmd.poll_fail)}"] if cmd.poll_fail else []
            if cmd.poll_timeout_s:
                stops.append(f"or after {cmd.poll_timeout_s:g} s")
            note = f" (repeat until it prints {cmd.poll_until}" + (
                f"; {' '.join(stops)}" if stops else "") + ")"
        elif cmd.may_fail:
            note = " (a failure here is reported, and the plan goes on)"
        lines.append(f"# {i}. {cmd.what}{note}")
        lines.append(cmd.shell())
    return "\n".join(lines)


def exit_status(returncode: int) -> int:
    """A child's return code as this process's exit status: a child killed by signal N
    (Popen's -N) becomes 128 + N, as a shell reports it, never -N (which sys.exit would
    turn into 256 - N: 247 for SIGKILL)."""
    return returncode if returncode >= 0 else 128 - returncode


def describe_exit(returncode: int) -> str:
    """'exit code 3', or 'killed by SIGKILL' for a child a signal ended."""
    import signal

    if returncode < 0 and -returncode in signal.valid_signals():
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def execute(plan: list[Command], out=sys.stdout, poll_s: float = 30.0,
            in_process=None) -> int:
    """Runs a plan; `in_process(cmd)` runs the in-process steps. Returns an exit code."""
    for i, cmd in enumerate(plan, 1):
        print(f"[{i}/{len(plan)}] {cmd.what}\n  $ {cmd.shell()}", file=out, flush=True)
        if cmd.in_process:
            code = in_process(cmd)
        elif cmd.poll_until:
            code = _poll(cmd, out, poll_s)
        else:
            code = _run(cmd, out)
        if code != 0 and cmd.may_fail:
            print(f"  (exit code {code}; going on)", file=out, flush=True)
        elif code != 0:
            print(f"step {i} failed with exit code {code}: {cmd.what}", file=out, flush=True)
            if cmd.on_fail:
                print(cmd.on_fail, file=out, flush=True)
            return code
    return 0


def _run(cmd: Command, out) -> int:
    """Runs a command, its output shown as it comes: on this terminal when `out` is stdout
    (gcloud may prompt, e.g. for a new ssh key), else through `out`."""
    direct = out is sys.stdout or out is sys.__stdout__
    try:
        proc = subprocess.Popen(cmd.argv, cwd=cmd.cwd,
                                stdout=None if direct else subprocess.PIPE,
                                stderr=None if direct else subprocess.STDOUT,
                                text=True, errors="replace")
    except FileNotFoundError as e:
        print(f"  cannot run {cmd.argv[0]!r}: {e}", file=out)
        return 127
    if not direct:
        for line in proc.stdout:
            print(f"  {line.rstrip()}", file=out, flush=True)
    return exit_status(proc.wait())


def _poll(cmd: Command, out, poll_s: float) -> int:
    """Repeats a status query until it prints `poll_until` (0), a `poll_fail` state or
    fails itself (1), or `poll_timeout_s` passes (1)."""
    start = time.monotonic()
    last = None
    while True:
        res = subprocess.run(cmd.argv, cwd=cmd.cwd, capture_output=True, text=True)
        state = res.stdout.strip()
        if res.returncode != 0:
            print(f"  {res.stderr.strip()}", file=out, flush=True)
            return exit_status(res.returncode)
        if state == cmd.poll_until:
            print(f"  ... {state}", file=out, flush=True)
            return 0
        if state in cmd.poll_fail:
            print(f"  ... {state}: the wait ends here; nothing more was started", file=out,
                  flush=True)
            return 1
        if state != last:
            print(f"  ... {state or '(no state yet)'}", file=out, flush=True)
            last = state
        if cmd.poll_timeout_s is not None and time.monotonic() - start > cmd.poll_timeout_s:
            print(f"  ... still {state or 'without a state'} after {cmd.poll_timeout_s:g} s; "
                  f"giving up", file=out, flush=True)
            return 1
        time.sleep(poll_s)
