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


class NotARunError(UserError, FileNotFoundError):
    """The location is not an actx run (or not a prepared one); the message says why."""
