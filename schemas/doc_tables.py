"""docs/p-XXXXX.jsonl, prepare's doc table of a partition: one JSON object a line for each
document that starts there (doc_index, doc_id, its file and line, where its first token
is). The reader (reader/provenance.py) and `actx verify` (deploy/verify.py) read a table
through `parse`, so a damaged one is one error with one remedy: the prepare again that
writes the same tokens and tables (what is committed stays).
"""

from __future__ import annotations

import json

from actx.schemas import advice
from actx.schemas import errors

# What every row holds, whatever else the prepare that wrote it recorded.
REQUIRED = ("doc_index", "doc_id")


class DamagedDocTableError(errors.UserError, ValueError):
    """A doc table that cannot be read as prepare wrote it; `what`: the damage alone (the
    table, its line and how), for a caller's own message."""

    def __init__(self, message: str, what: str):
        super().__init__(message)
        self.what = what


def parse(data: bytes, where: str, run: object) -> list[dict]:
    """The rows of the table whose bytes are `data` (`where`: its location, for the error;
    `run`: the run's location, for the command that writes it again)."""
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        raise _damaged(f"{where}: not UTF-8 ({e})", run) from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise _damaged(f"{where}:{n}: not JSON ({e})", run) from None
        if not isinstance(row, dict) or any(key not in row for key in REQUIRED):
            raise _damaged(f"{where}:{n}: not a document's row (it has no "
                           f"{' or '.join(REQUIRED)})", run)
        rows.append(row)
    return rows


def _damaged(what: str, run: object) -> DamagedDocTableError:
    return DamagedDocTableError(
        f"{what}: the doc table was damaged after prepare; `{advice.reprepare(run)}` writes "
        f"the same tokens and tables again (what is committed stays)", what)
