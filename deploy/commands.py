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
    in_process: run by actx itself (e.g. prepare); argv is the equivalent command line.
    """

    argv: tuple[str, ...]
    what: str
    cwd: str | None = None
    poll_until: str | None = None
    in_process: bool = False

    def shell(self) -> str:
        line = shlex.join(self.argv)
        return f"(cd {shlex.quote(self.cwd)} && {line})" if self.cwd else line


def render_plan(plan: list[Command]) -> str:
    lines = []
    for i, cmd in enumerate(plan, 1):
        note = f" (repeat until it prints {cmd.poll_until})" if cmd.poll_until else ""
        lines.append(f"# {i}. {cmd.what}{note}")
        lines.append(cmd.shell())
    return "\n".join(lines)


def execute(plan: list[Command], out=sys.stdout, poll_s: float = 30.0,
            in_process=None) -> int:
    """Runs a plan; `in_process(cmd)` runs the in-process steps. Returns an exit code."""
    for i, cmd in enumerate(plan, 1):
        print(f"[{i}/{len(plan)}] {cmd.what}\n  $ {cmd.shell()}", file=out, flush=True)
        if cmd.in_process:
            code = in_process(cmd)
        elif cmd.poll_until:
            while True:
                res = subprocess.run(cmd.argv, cwd=cmd.cwd, capture_output=True, text=True)
                if res.returncode != 0:
                    print(res.stderr, file=out)
                    code = res.returncode
                    break
                if res.stdout.strip() == cmd.poll_until:
                    code = 0
                    break
                print(f"  ... {res.stdout.strip() or '(no state yet)'}", file=out, flush=True)
                time.sleep(poll_s)
        else:
            try:
                code = subprocess.run(cmd.argv, cwd=cmd.cwd).returncode
            except FileNotFoundError as e:
                print(f"  cannot run {cmd.argv[0]!r}: {e}", file=out)
                code = 127
        if code != 0:
            print(f"step {i} failed with exit code {code}: {cmd.what}", file=out, flush=True)
            return code
    return 0
