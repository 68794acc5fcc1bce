"""The progress line of a job a launcher waits for: each extraction's status, read at every
poll from the run as that extraction sees it, as a `ProgressLine.show` wants it.

Apart from the launchers (`deploy.local` for worker processes, `deploy.targets.beam` for a
Beam pipeline) because both poll the same way: the run opened once and only when first
needed, each extraction's view made once, and progress best effort (a failure to read it
is shown on the line; the workers or the pipeline decide the outcome).
"""

from __future__ import annotations

from typing import Callable

from actx.deploy.status import runstate
from actx.deploy.status import text as status_text
from actx.schemas import extraction as extraction_lib
from actx.schemas import run_dir


class JobProgress:
    """`poll()` gives the line's `make(width)`; `run` is the run directory, a
    run_dir.OpenedRun once opened (at the first poll, unless the launcher had it so)."""

    def __init__(self, run: run_dir.RunDir, names):
        self.run, self.names = run, names
        self._scoped: dict | None = None  # {extraction: the run as it sees it}
        self._phases_said: set[tuple[str, str]] = set()
        self._phases_new: list[str] = []

    def views(self) -> dict:
        """{extraction: the run as it sees it}, made at the first call."""
        if self._scoped is None:
            self.run = self.run.opened()
            self._scoped = {name: extraction_lib.scoped(self.run, name)
                            for name in self.names}
        return self._scoped

    def poll(self, also: Callable[[dict], None] | None = None) -> Callable[[int | None], str]:
        """The line for each extraction's status now. `also(views)` runs after, in the same
        try (a launcher's own check of the heartbeats): a failure of either shows as the
        line "(progress unavailable: ...)"."""
        try:
            views = self.views()
            statuses = {name: runstate.compute_status(h) for name, h in views.items()}
            self._note_phases(statuses)
            if also is not None:
                also(views)
            return lambda width: status_text.lines_per_extraction(statuses, width)
        except Exception as e:  # progress is best effort; the workers decide the outcome
            return lambda width, e=e: status_text.fit(f"(progress unavailable: {e})", width)

    def _note_phases(self, statuses: dict) -> None:
        """Each start-up phase a live host reports before its first token (loading the
        model, its weights, compiling the step), once: the longest wait of a small run,
        which the progress line alone (rewritten in place, or in a pipe every few
        seconds) would leave out of a log."""
        for name, status in statuses.items():
            for h in status.hosts:
                if h.live and h.tokens_done == 0 and h.message:
                    key = (f"{name + ': ' if name else ''}{h.host}", h.message)
                    if key not in self._phases_said:
                        self._phases_said.add(key)
                        self._phases_new.append(f"{key[0]} {h.message}")

    def new_phases(self) -> list[str]:
        """The start-up phases seen since the last call, one line each."""
        new, self._phases_new = self._phases_new, []
        return new
