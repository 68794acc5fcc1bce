"""The one base class of errors caused by what the user gave: a config, a flag, an input
file, a run directory that is not what the command needs. Each says what was wrong, where
and what to do; the command line prints it as one line and exits 2.

Errors of each part subclass it (ConfigError, InputError, PrepareError, RunMismatch,
TargetError, StoreError, the reader's errors, ...), keeping the builtin base they always
had (ValueError, FileNotFoundError, ...) so existing `except` clauses still hold.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: printed as one line, exit code 2."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """An error's first line, cut between words (marked " ...") when longer than `limit`,
    for a message that quotes a library's error: tensorstore repeats the whole spec after
    the cause, XLA a whole module. An error with no words gives its type's name."""
    lines = str(e).strip().splitlines()
    line = lines[0] if lines else type(e).__name__
    if len(line) <= limit:
        return line
    cut = line.rfind(" ", 0, limit)
    return line[:cut if cut > limit // 2 else limit].rstrip(" ,;:") + " ..."


class NotARunError(UserError, FileNotFoundError):
    """The location is not an actx run (or not a prepared one); the message says why."""
