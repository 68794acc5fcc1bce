"""The manifest: partitions of the token store and the input accounting of prepare.

Written once by prepare; read by workers, ops and the reader. Its counts reconcile:
docs read = docs accepted + docs rejected, per source and in total.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import json

from actx.schemas import config as config_lib
from actx.schemas import layout

# 2: partitions stored as columns ({"id": [...], "tokens": [...], ...}): 150k partitions
# load in ~0.2 s instead of ~1.5 s as objects. Version 1 manifests (a list of partition
# objects) still load.
# 3: the partition column `longest_doc_rows`; earlier manifests read with it 0 (not
# recorded). An actx before it refuses a version 3 manifest by that column's name.
# 4: the partition columns `continued_doc_rows` and `continued_from_rows` (a document
# continued from the partition before: its rows here, and before); earlier manifests read
# with them 0. An actx before it refuses a version 4 manifest by their names.
MANIFEST_VERSION = 4


@dataclasses.dataclass(frozen=True)
class Partition:
    """A fixed, contiguous row range [row_start, row_start + row_count).

    tokens: non-padding tokens in the partition; docs: documents starting in it.
    full_context_tokens: tokens that saw their whole document up to themselves
      (`tokens/context_start` == 0).
    longest_doc_rows: the most consecutive rows of the partition one document runs
      through (a row continues the document of the row before when its column 0 holds a
      document token at a position > 0): the rows a worker runs one after another through
      one batch slot, so it takes partitions with long ones first. 0: not recorded
      (manifests before version 3).
    continued_doc_rows: when the partition's first row continues a document of the
      partition before, the consecutive rows of the partition that document runs through
      (0 when the first row does not continue one, and in manifests before version 4).
    continued_from_rows: that document's rows before the partition (its position at the
      first row's column 0 // seq_len): a worker runs up to its model's warm-up rows of
      them first, in the same slot, so the partition's first chain is continued_doc_rows
      + min(continued_from_rows, warm-up rows) long. 0 as continued_doc_rows is.
    """

    id: int
    row_start: int
    row_count: int
    tokens: int
    docs: int
    full_context_tokens: int = 0
    longest_doc_rows: int = 0
    continued_doc_rows: int = 0
    continued_from_rows: int = 0

    @property
    def row_stop(self) -> int:
        return self.row_start + self.row_count

    @property
    def name(self) -> str:
        return layout.partition_name(self.id)


class PartitionTable(collections.abc.Sequence):
    """manifest.json's partition columns, read as a sequence of `Partition` that builds its
    objects only when one is asked for. Status at 150k partitions sums columns
    (`column`) instead of building 150k objects (0.34 s). Equal to the tuple of the same
    partitions; iterating builds and keeps them all."""

    __slots__ = ("_columns", "_objects")

    def __init__(self, columns: dict[str, list]):
        # Every field of Partition, in its order (config.checked_columns gives that).
        self._columns = columns
        self._objects: tuple[Partition, ...] | None = None

    def __len__(self) -> int:
        return len(self._columns["id"])

    def __getitem__(self, index):
        if self._objects is not None or isinstance(index, slice):
            return self._all()[index]
        return Partition(*(col[index] for col in self._columns.values()))

    def __iter__(self):
        return iter(self._all())

    def _all(self) -> tuple[Partition, ...]:
        if self._objects is None:
            self._objects = tuple(map(Partition, *self._columns.values()))
        return self._objects

    def __eq__(self, other) -> bool:
        if isinstance(other, (tuple, PartitionTable)):
            return self._all() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return f"PartitionTable({len(self)} partitions)"

    def __reduce__(self):
        return PartitionTable, (self._columns,)

    def column(self, name: str) -> list:
        """One field of every partition, in manifest order."""
        return self._columns[name]

    def columns(self) -> dict[str, list]:
        return {name: list(col) for name, col in self._columns.items()}


def partition_column(partitions, name: str) -> list:
    """Field `name` of every partition (a PartitionTable's column, or read off objects)."""
    if isinstance(partitions, PartitionTable):
        return partitions.column(name)
    return [getattr(p, name) for p in partitions]


@dataclasses.dataclass(frozen=True)
class SourceCounts:
    """Input accounting of one source: read = accepted + rejected."""

    read: int = 0
    accepted: int = 0
    rejected: int = 0
    truncated_tokens: int = 0
    # Rejects by kind of reason (layout.reject_kind: "not valid JSON": 3); {} in runs
    # prepared before it was recorded.
    reasons: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Manifest:
    """fingerprint: the RunSpec fingerprint the token store was prepared for.

    total_rows: rows of every token array (and of every activation array).
    total_tokens: non-padding tokens over all rows.
    sources: per source name, its input accounting.
    arc_tasks: ARC task ids; `tokens/arc_task` holds indices into this list.
    vocab_size: size of the tokenizer vocabulary (workers check the model against it).
    special_token_ids: ids of the tokenizer's special tokens (readers can exclude them).
    bos_id / eos_id: the tokenizer's BOS and EOS ids (None when it has none).
    """

    fingerprint: str
    seq_len: int
    total_rows: int
    total_tokens: int
    # A tuple, or (read from manifest.json) a PartitionTable: a sequence either way.
    partitions: tuple[Partition, ...]
    sources: dict[str, SourceCounts]
    vocab_size: int
    arc_tasks: tuple[str, ...] = ()
    special_token_ids: tuple[int, ...] = ()
    bos_id: int | None = None
    eos_id: int | None = None
    version: int = MANIFEST_VERSION

    @property
    def docs_read(self) -> int:
        return sum(s.read for s in self.sources.values())

    @property
    def docs_accepted(self) -> int:
        return sum(s.accepted for s in self.sources.values())

    @property
    def docs_rejected(self) -> int:
        return sum(s.rejected for s in self.sources.values())

    def partition(self, partition_id: int) -> Partition:
        if not 0 <= partition_id < len(self.partitions):
            raise KeyError(f"partition {partition_id} does not exist "
                           f"(the run has {len(self.partitions)} partitions)")
        return self.partitions[partition_id]

    def to_json_obj(self) -> dict:
        obj = config_lib.to_dict(dataclasses.replace(self, partitions=()))
        obj["partitions"] = (self.partitions.columns()
                             if isinstance(self.partitions, PartitionTable)
                             else config_lib.to_columns(self.partitions, Partition))
        obj["totals"] = {"docs_read": self.docs_read, "docs_accepted": self.docs_accepted,
                         "docs_rejected": self.docs_rejected}
        return obj

    @classmethod
    def from_json_obj(cls, data: dict, where: str = layout.MANIFEST_KEY) -> "Manifest":
        """Loads both encodings of partitions: columns (version 2) and a list of objects."""
        if not isinstance(data, dict):
            raise config_lib.ConfigError(f"{where}: expected a JSON object; the file is not "
                                         f"a manifest (rerun `actx prepare`)")
        data = dict(data)
        data.pop("totals", None)
        version = data.get("version", 1)
        if type(version) is int and version > MANIFEST_VERSION:
            raise config_lib.ConfigError(
                f"{where}: manifest version {version} was written by a newer actx (this one "
                f"reads versions 1 to {MANIFEST_VERSION}); upgrade actx "
                f"(pip install --upgrade actx-lm) to read this run")
        columns = data.get("partitions")
        if not isinstance(columns, dict):  # version 1: a list of objects
            return config_lib.from_dict(cls, data, where + ": ")
        table = PartitionTable(config_lib.checked_columns(Partition, columns,
                                                          f"{where}: partitions"))
        manifest = config_lib.from_dict(cls, dict(data, partitions=()), where + ": ")
        return dataclasses.replace(manifest, partitions=table)


def rejects_words(manifest: Manifest) -> str:
    """The rejects in one phrase, "" when none: the count and, per source, the reasons
    with their counts ("3 input(s) rejected (docs: not valid JSON 2, no text field 1)")."""
    if not manifest.docs_rejected:
        return ""
    per_source = []
    for name, counts in sorted(manifest.sources.items()):
        if not counts.rejected:
            continue
        reasons = ", ".join(f"{kind} {n:,}" for kind, n in sorted(
            counts.reasons.items(), key=lambda kv: (-kv[1], kv[0])))
        per_source.append(f"{name}: {reasons or f'{counts.rejected:,}'}")
    return (f"{manifest.docs_rejected:,} input(s) rejected ({'; '.join(per_source)})")


def read_manifest(store) -> Manifest:
    data = store.read_json(layout.MANIFEST_KEY)
    if data is None:
        raise FileNotFoundError(
            f"{store.location.join(layout.MANIFEST_KEY)}: missing; the run has not been "
            f"prepared (run `actx prepare` first)")
    return Manifest.from_json_obj(data, str(store.location.join(layout.MANIFEST_KEY)))


def encode(manifest: Manifest) -> bytes:
    """manifest.json's bytes: one key per line, each partition column on one line, so the
    file stays readable and small (~35 bytes per partition)."""
    obj = manifest.to_json_obj()

    def compact(value) -> str:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))

    columns = ",\n".join(f"  {json.dumps(name)}: {compact(col)}"
                          for name, col in sorted(obj.pop("partitions").items()))
    lines = [f" {json.dumps(k)}: {compact(v)}" for k, v in sorted(obj.items())]
    lines.append(f' "partitions": {{\n{columns}\n }}')
    return ("{\n" + ",\n".join(lines) + "\n}\n").encode()


def write_manifest(store, manifest: Manifest) -> None:
    store.write(layout.MANIFEST_KEY, encode(manifest))
