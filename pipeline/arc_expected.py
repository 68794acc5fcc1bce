"""The answer an ARC document asks for: its test output grids as the document's variant
renders them, and the grid encoder of its source, found from its doc-table row.

A generating run's prepare records both in each ARC document's doc-table row
("arc_expected", "arc_encoder"; `expected_outputs` computes the first), and its workers
judge the answers with them. Other runs do not: for those, a doc-table row
(docs/p-NNNNN.jsonl) of an ARC document holds "task_id", "variant" (the variant number),
"transform" (`arc_render.Variant.description`: the dihedral transform and colour map),
"source" (the source's name), "file" and "row" (ARC-AGI JSON: the task's index in the
file) or "line" (ARC JSONL: 1-based line); run.json's source of that name holds
arc_encoder. So the task is read again from its input file, and transformed here with
arc_render's own `transform_task`, as tokenize did when it rendered the prompt.
"""

from __future__ import annotations

from actx.pipeline import arc_render
from actx.pipeline import sources
from actx.schemas import runspec as runspec_lib

Grid = list[list[int]]
COLOURS_FIELD = ";colours="  # how Variant.description writes a colour map


def variant_of(doc: dict) -> arc_render.Variant:
    """The variant of an ARC doc-table row, from its "variant" and "transform" fields."""
    try:
        index, transform = int(doc["variant"]), str(doc["transform"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"doc {doc.get('doc_id')!r}: no integer 'variant' and 'transform' "
                         f"fields; not an ARC document of a prepared run") from None
    dihedral, _, colours = transform.partition(COLOURS_FIELD)
    colour_map = tuple(int(c) for c in colours) if colours.isdigit() else (
        tuple(range(10)) if not colours else None)
    if (dihedral not in arc_render.DIHEDRAL or colour_map is None
            or sorted(colour_map) != list(range(10))):
        raise ValueError(f"doc {doc.get('doc_id')!r}: transform {transform!r} is not a "
                         f"dihedral transform ({', '.join(arc_render.DIHEDRAL)}) with an "
                         f"optional '{COLOURS_FIELD}' permutation of the digits 0-9")
    return arc_render.Variant(index, dihedral, colour_map)


def expected_outputs(task: dict, variant: arc_render.Variant) -> list[Grid | None]:
    """Each test pair's output grid as the variant's document renders it, None for a
    test without an output (hidden evaluation answers)."""
    transformed = arc_render.transform_task(task, variant)
    return [pair.get("output") for pair in transformed["test"]]


def expected_output(task: dict, variant: arc_render.Variant, test_index: int = 0
                    ) -> Grid | None:
    """Test `test_index`'s output grid as the variant's document renders it (or None)."""
    return expected_outputs(task, variant)[test_index]


def source_of(spec: runspec_lib.RunSpec, doc: dict) -> tuple[int, runspec_lib.SourceSpec]:
    """(index, spec) of the ARC source a doc-table row names in its "source" field."""
    for index, source in enumerate(spec.sources):
        if spec.source_name(index) == doc.get("source"):
            if source.kind != "arc":
                raise ValueError(f"doc {doc.get('doc_id')!r}: source {doc['source']!r} is "
                                 f"a {source.kind} source, not an ARC one")
            return index, source
    names = [spec.source_name(i) for i in range(len(spec.sources))]
    raise ValueError(f"doc {doc.get('doc_id')!r}: source {doc.get('source')!r} is not one of "
                     f"the run's sources {names}")


def encoder_of(spec: runspec_lib.RunSpec, doc: dict) -> str:
    """The grid encoder ("digits", "rows", "shape") the document's prompt was written in."""
    return source_of(spec, doc)[1].arc_encoder


def read_task(spec: runspec_lib.RunSpec, doc: dict) -> dict:
    """The document's task ({"train", "test"}) read again from its input file, as prepare
    read it (the file must still hold what it held then: the task id is checked)."""
    index, source = source_of(spec, doc)
    line_kind = "row" if "row" in doc else "line"
    for record in sources.read_file(index, source, spec.source_name(index), doc["file"]):
        if isinstance(record, sources.ArcTaskRecord) and record.line == doc.get(line_kind):
            if record.task_id != doc.get("task_id"):
                raise ValueError(f"{doc['file']} {line_kind} {record.line}: holds task "
                                 f"{record.task_id!r}, the doc table says "
                                 f"{doc.get('task_id')!r}; the file changed since prepare")
            return record.task
    raise ValueError(f"{doc['file']}: no valid ARC task at {line_kind} {doc.get(line_kind)} "
                     f"(doc {doc.get('doc_id')!r}); the file changed since prepare")
