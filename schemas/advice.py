"""Every command actx advises its user to type (status, the live page, submit, rerun,
verify, the launchers of every target), made here from one table of kinds: what a kind's
command is, with the run's or config's path filled in. A test enumerates the table and
follows each kind as printed in a situation that prints it (tests/test_advice_followed.py,
tests/advice_follow.py); `find` tells a printed command back to its kind."""

from __future__ import annotations

import dataclasses
import re
import shlex


@dataclasses.dataclass(frozen=True)
class Kind:
    """name: the kind; template: its command, `{run}` / `{target}` / `{config}` filled in
    by `command`; does: what following it does."""

    name: str
    template: str
    does: str


KINDS = {kind.name: kind for kind in (
    Kind("rerun", "actx rerun {run}",
         "extracts every uncommitted partition, on the target the run last launched on"),
    Kind("rerun_on", "actx rerun {run} --target {target} --config {config}",
         "the same, on that target with that config's target table"),
    Kind("rerun_recreate", "actx rerun {run} --target {target} --config {config} --recreate",
         "the same, creating the TPU slice again first (after a preemption or deletion)"),
    Kind("verify", "actx verify {run}",
         "re-reads every committed block against its commit marker's checksum"),
    Kind("repair", "actx verify {run} --repair",
         "turns the partitions whose data failed (or is gone) back into pending"),
    Kind("status", "actx status {run}", "where the run stands, in words"),
    Kind("watch", "actx status {run} --watch", "follows the run's progress until it ends"),
    Kind("status_json", "actx status {run} --json", "the run's status, for a script"),
    Kind("down", "actx down --config {config}",
         "stops the config's workers (scancel; deletes the TPU slice) and frees the run"),
    Kind("read", "python -c \"import actx; print(actx.open_run('{run}').describe())\"",
         "opens the run with the reader and describes what it holds"),
    Kind("reprepare", "actx prepare --out {run} --spec {spec}",
         "prepares the run again from the inputs its run.json names: the same tokens, "
         "written again (a damaged token store whole again); what is committed stays"),
)}


def command(kind: str, **fields: object) -> str:
    """The command of `kind` with its fields filled in (a KeyError names a missing one),
    each one shell word as printed: a path with a space, a quote or a character outside
    ASCII is quoted (shlex), one of letters, digits and `/._-:` left as it is."""
    values = {k: str(v) for k, v in fields.items()}
    if kind == "read":  # the path inside Python's '...' inside the shell's "..."
        if not any(c in values["run"] for c in "'\"$`\\!\n"):
            return KINDS[kind].template.format(**values)
        code = f"import actx; print(actx.open_run({values['run']!r}).describe())"
        return f"python -c {shlex.quote(code)}"  # Python's own literal, one shell word
    return KINDS[kind].template.format(**{k: shlex.quote(v) for k, v in values.items()})


def rerun(run: object) -> str:
    return command("rerun", run=run)


def rerun_on(run: object, target: str, config: object) -> str:
    return command("rerun_on", run=run, target=target, config=config)


def rerun_recreate(run: object, config: object) -> str:
    return command("rerun_recreate", run=run, target="tpu-vm", config=config)


def verify(run: object) -> str:
    return command("verify", run=run)


def repair(run: object) -> str:
    return command("repair", run=run)


def status(run: object) -> str:
    return command("status", run=run)


def watch(run: object) -> str:
    return command("watch", run=run)


def status_json(run: object) -> str:
    return command("status_json", run=run)


def down(config: object) -> str:
    return command("down", config=config)


def read(run: object) -> str:
    return command("read", run=run)


def reprepare(run: object) -> str:
    return command("reprepare", run=run, spec=f"{str(run).rstrip('/')}/run.json")


# One shell word as `command` prints a field: plain, or quoted by shlex ('...', with
# '"'"' for a quote inside).
_WORD = r"""(?:[^\s`'"]+|'[^']*')(?:'[^']*'|"'"|[^\s`'"])*"""


def _pattern(kind: Kind) -> re.Pattern:
    """A printed command of `kind`: its template with each field one shell word."""
    parts = re.split(r"(\{\w+\})", kind.template)
    return re.compile("".join(r"(?P<%s>%s)" % (p[1:-1], _WORD) if p.startswith("{")
                              else re.escape(p) for p in parts) + r"(?=$|[\s`\"';,)])")


_PATTERNS = sorted(((name, _pattern(kind)) for name, kind in KINDS.items()),
                   key=lambda item: -len(KINDS[item[0]].template))


def find(text: str) -> list[tuple[str, str]]:
    """(kind, command as printed) of every advised command in `text`, in order: the
    longest kind that matches at each place (`actx verify RUN --repair` is a repair, not
    a verify)."""
    found, taken = [], []
    for name, pattern in _PATTERNS:
        for m in pattern.finditer(text):
            if not any(a < m.end() and m.start() < b for a, b in taken):
                taken.append((m.start(), m.end()))
                found.append((m.start(), name, m.group(0)))
    return [(name, cmd) for _, name, cmd in sorted(found)]
