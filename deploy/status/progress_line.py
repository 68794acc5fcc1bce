"""Where a launcher's progress line goes: on a terminal, one line rewritten in place, cut
to the terminal's width (a longer line wraps, and the next rewrite leaves the wrapped
part behind, so fragments pile up); into a pipe or a file, whole lines, a new one only
when it says something new and no more often than every `pipe_every_s` seconds (a log
that a CI job or `tee` keeps should not grow by a line every poll)."""

from __future__ import annotations

import shutil
import time
from typing import Callable

from actx.deploy import columns

PIPE_EVERY_S = 10.0  # at most one progress line this often in a pipe or a file


class ProgressLine:
    """`show(make)` with `make(width)` giving the line for `width` columns (None: any)."""

    def __init__(self, out, pipe_every_s: float = PIPE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.out = out
        self.tty = hasattr(out, "isatty") and out.isatty()
        self.pipe_every_s = pipe_every_s
        self.clock = clock
        self._last = ""
        self._last_at: float | None = None
        self._open = False  # a line rewritten in place that no newline has ended yet

    @staticmethod
    def width() -> int:
        """The terminal's columns less one: a line that fills the last column makes some
        terminals wrap."""
        return max(20, shutil.get_terminal_size((80, 24)).columns - 1)

    def show(self, make: Callable[[int | None], str], force: bool = False) -> None:
        """Shows the line `make` gives; in a pipe only when it changed and the last one is
        `pipe_every_s` old (`force`: whenever it changed, e.g. the last one)."""
        if self.tty:
            line = make(self.width())
            print("\r\x1b[2K" + line, end="", file=self.out, flush=True)
            self._open = True
            return
        line = make(None)
        now = self.clock()
        due = (self._last_at is None or now - self._last_at >= self.pipe_every_s or force)
        if line != self._last and due:
            print(line, file=self.out, flush=True)
            self._last, self._last_at = line, now

    def note(self, line: str) -> None:
        """A line of its own (a start-up phase), tty or not: on a terminal it replaces the
        line rewritten in place, which the next `show` draws again below it."""
        if self.tty:  # wrapped here: the stream passes what follows a "\r" as it is
            print("\r\x1b[2K" + "\n".join(columns.fit(line, self.width())), file=self.out,
                  flush=True)
            self._open = False
        else:
            print(line, file=self.out, flush=True)

    def end(self) -> None:
        """Ends the line rewritten in place, so what follows starts on its own line."""
        if self._open:
            print(file=self.out, flush=True)
            self._open = False
