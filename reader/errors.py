"""Errors the reader raises, each saying what was wrong, where, and what to do."""

from __future__ import annotations

from actx.schemas import errors as schemas_errors


class ReaderError(schemas_errors.UserError):
    """Base class of reader errors."""


class NotARunError(ReaderError, schemas_errors.NotARunError):
    """The location has no run.json / manifest.json: it is not an actx run."""


class UnknownHookError(ReaderError, KeyError):
    """A hook that no committed partition of the run holds."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


class UncommittedPartitionError(ReaderError):
    """Rows of a partition without a commit marker were asked for."""


class NothingCommittedError(UncommittedPartitionError, UnknownHookError):
    """The run has no committed partition yet: nothing is readable. Every reading entry
    point raises this same error (it is also an UnknownHookError and an
    UncommittedPartitionError, so existing handlers of either still hold)."""


class LostDataError(ReaderError):
    """Committed partitions whose stored activations are gone (an object deleted after
    its commit): a read would return zeros in their place, so none is made. The message
    names them and the commands that extract them again (reader.shard_presence). Also a
    document looked up where committed partitions lost their doc tables (prepare writes
    them again: reader.provenance)."""


class AmbiguousDocumentError(ReaderError, KeyError):
    """A doc_id that names several documents (ids are the data's, or "<file>:<line>" of
    files of one name in two folders): the message lists them by doc_index, the key that
    names one."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


class RunStalledError(ReaderError, TimeoutError):
    """A reader following a live run waited its timeout for a commit that did not come;
    the message says the run's phase, its dead hosts and what `actx status` advises."""


class FailedVerificationWarning(UserWarning):
    """The latest `actx verify` of the run found committed partitions whose data is not
    what their markers say: what is read of them may be wrong (an object that is gone
    reads as zeros). The message names them and the commands that extract them again."""
