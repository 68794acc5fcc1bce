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
            if also is not None:
                also(views)
            return lambda width: status_text.lines_per_extraction(statuses, width)
        except Exception as e:  # progress is best effort; the workers decide the outcome
            return lambda width, e=e: status_text.fit(f"(progress unavailable: {e})", width)
