"""The prepare pipeline as Beam transforms: read → tokenize → pack per group → plan →
write partitions.

Scale: no step holds per-document state for the whole run. Documents are read, rendered
and tokenized in parallel, each keyed by its sort key (source index, file, line/row,
variant). They are grouped by pack group (`pack_group`: one file, or one fixed block of
its lines) and each group is packed on its own into group-local rows. The only global
steps see one small record per file (`partition.file_limits`: the max_docs cut, only when
a source has max_docs) and one per pack group (`partition.build_plan`: prefix sums giving
each group's first run-wide row and doc_index, the ARC task table, the counts). Rows then
get their run-wide numbers and are grouped by partition (GroupByKey on row //
partition_rows); each partition is written by one DoFn call.

Determinism: document order, packing and partitions are a pure function of the document
keys and token counts, never of bundle or worker order, so the arrays and the doc tables
are byte-identical whatever the runner, its worker count or its running mode.
"""

from __future__ import annotations

import logging
import time

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.pvalue import AsList, AsSingleton

from pipeline import pack_group
from pipeline import partition as partition_lib
from pipeline import sources
from pipeline import tokenize
from pipeline import write_store
from schemas import runspec as runspec_lib

NAMESPACE = "actx.prepare"
REJECTS_TAG = "rejects"
ARC_TAG = "arc"
ROWS_TAG = "rows"
_log = logging.getLogger(__name__)


class _Progress:
    """Logs a line at most every `every_s` seconds (long local runs show progress)."""

    def __init__(self, what: str, every_s: float = 10.0):
        self.what, self.every_s, self.count, self.last = what, every_s, 0, time.monotonic()

    def add(self, n: int, detail: str = "") -> None:
        self.count += n
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            _log.info("prepare: %s %d %s", self.what, self.count, detail)


def count_records(spec: runspec_lib.RunSpec, element: tuple[int, str]) -> tuple[tuple, int]:
    """((source_index, path), records the file holds up to the source's max_docs).

    Records are what max_docs counts: documents, ARC tasks and rejects alike, so this is
    exactly how many records `ReadFileFn` yields for the file given a larger limit.
    """
    source_index, path = element
    source = spec.sources[source_index]
    n = sum(1 for _ in sources.read_file(source_index, source, spec.source_name(source_index),
                                         path, limit=source.max_docs))
    return (source_index, path), n


class ReadFileFn(beam.DoFn):
    """(source_index, path[, limit]) → TextRecord (main), ArcTaskRecord ('arc'), Reject
    ('rejects'); limit: records to read from the file (default: the source's max_docs)."""

    def __init__(self, spec: runspec_lib.RunSpec):
        self.spec = spec
        self.read = Metrics.counter(NAMESPACE, "records_read")
        self.rejected = Metrics.counter(NAMESPACE, "records_rejected")

    def process(self, element):
        source_index, path, *limit = element
        source = self.spec.sources[source_index]
        limit = limit[0] if limit else source.max_docs
        if limit == 0:  # beyond the source's max_docs: not even an unreadable-file reject
            return
        for record in sources.read_file(source_index, source, self.spec.source_name(source_index),
                                        path, limit=limit):
            self.read.inc()
            if isinstance(record, sources.Reject):
                self.rejected.inc()
                yield beam.pvalue.TaggedOutput(REJECTS_TAG, record)
            elif isinstance(record, sources.ArcTaskRecord):
                yield beam.pvalue.TaggedOutput(ARC_TAG, record)
            else:
                yield record


class TokenizeFn(beam.DoFn):
    """Batches of TextRecord / ArcVariantRecord → TokenizedDoc; the tokenizer loads once."""

    def __init__(self, spec: runspec_lib.RunSpec):
        self.spec = spec
        self.docs = Metrics.counter(NAMESPACE, "docs_tokenized")
        self.tokens = Metrics.counter(NAMESPACE, "tokens")
        self.loaded = None

    def setup(self):
        self.loaded = tokenize.load_tokenizer(self.spec.tokenizer.path)
        self.progress = _Progress("documents tokenized")

    def process(self, batch):
        docs = tokenize.encode_batch(self.loaded, self.spec, list(batch))
        n_tokens = sum(len(d.token_ids) for d in docs)
        self.docs.inc(len(docs))
        self.tokens.inc(n_tokens)
        self.progress.add(len(docs), "(this worker)")
        yield from docs


class PackGroupFn(beam.DoFn):
    """(group key, [TokenizedDoc]) → GroupSummary (main) and group-local Rows ('rows')."""

    def __init__(self, spec: runspec_lib.RunSpec, separator_id: int | None):
        self.spec, self.separator_id = spec, separator_id
        self.groups = Metrics.counter(NAMESPACE, "groups_packed")

    def process(self, element):
        key, docs = element
        summary, rows = pack_group.pack_group(self.spec, self.separator_id, key, docs)
        self.groups.inc()
        yield summary
        for row in rows:
            yield beam.pvalue.TaggedOutput(ROWS_TAG, row)


class WritePartitionFn(beam.DoFn):
    """(partition_id, [placed Row]) → written stats; one call writes one shard object."""

    def __init__(self, spec: runspec_lib.RunSpec, run_uri: str):
        self.spec, self.run_uri = spec, run_uri
        self.partitions = Metrics.counter(NAMESPACE, "partitions_written")

    def setup(self):
        self.progress = _Progress("partitions written")

    def process(self, element, plan):
        partition_id, rows = element
        stats = write_store.write_partition(self.run_uri, self.spec, plan, partition_id,
                                            list(rows))
        self.partitions.inc()
        self.progress.add(1, f"of {plan.n_partitions}")
        yield stats


def _with_limits(p: beam.Pipeline, spec: runspec_lib.RunSpec, files: list[tuple[int, str]]):
    """(source_index, path, limit) per file; limit None where the source has no max_docs.

    With max_docs, a first pass counts each capped file's records (one number per file)
    and one global step over those counts cuts each source in file order.
    """
    capped = [f for f in files if spec.sources[f[0]].max_docs is not None]
    if not capped:
        return p | "Files" >> beam.Create([(s, path, None) for s, path in files])
    limits = (p
              | "CappedFiles" >> beam.Create(capped)
              | "SpreadCapped" >> beam.Reshuffle()
              | "CountRecords" >> beam.Map(lambda f: count_records(spec, f))
              | "AllFileCounts" >> beam.combiners.ToList()
              | "FileLimits" >> beam.Map(lambda counts: partition_lib.file_limits(spec, counts)))
    return (p
            | "Files" >> beam.Create(files)
            | "AddLimits" >> beam.Map(lambda f, lim: (f[0], f[1], lim.get(tuple(f))),
                                      lim=AsSingleton(limits)))


def build(p: beam.Pipeline, spec: runspec_lib.RunSpec, run_uri: str,
          files: list[tuple[int, str]], separator_id: int | None) -> None:
    """Adds the prepare transforms to `p`; `files` are (source_index, path), pre-expanded."""
    read = (_with_limits(p, spec, files)
            | "SpreadFiles" >> beam.Reshuffle()
            | "Read" >> beam.ParDo(ReadFileFn(spec)).with_outputs(REJECTS_TAG, ARC_TAG,
                                                                  main="text"))
    variants = read[ARC_TAG] | "ArcVariants" >> beam.FlatMap(
        lambda rec: tokenize.expand_arc_variants(rec, spec.sources[rec.source_index]))
    docs = ((read.text, variants)
            | "Documents" >> beam.Flatten()
            | "Batch" >> beam.BatchElements(min_batch_size=8, max_batch_size=256)
            | "Tokenize" >> beam.ParDo(TokenizeFn(spec)))

    packed = (docs
              | "KeyByGroup" >> beam.Map(lambda d: (pack_group.group_key(d.key), d))
              | "GroupDocs" >> beam.GroupByKey()
              | "PackGroups" >> beam.ParDo(PackGroupFn(spec, separator_id)).with_outputs(
                  ROWS_TAG, main="summaries"))
    # The one global step: one summary per pack group, never per document.
    plan = (packed.summaries
            | "AllGroupSummaries" >> beam.combiners.ToList()
            | "Plan" >> beam.Map(lambda summaries: partition_lib.build_plan(spec, summaries))
            | "CreateArrays" >> beam.Map(lambda pl: write_store.create_token_arrays(
                run_uri, pl, spec)))

    written = (packed[ROWS_TAG]
               | "PlaceRows" >> beam.Map(
                   lambda row, plan: partition_lib.place_row(plan, row), plan=AsSingleton(plan))
               | "GroupPartitions" >> beam.GroupByKey()
               | "WritePartitions" >> beam.ParDo(WritePartitionFn(spec, run_uri),
                                                 plan=AsSingleton(plan)))

    rejects_written = (read[REJECTS_TAG]
                       | "KeyRejects" >> beam.Map(lambda r: (r.source, r))
                       | "GroupRejects" >> beam.GroupByKey()
                       | "WriteRejects" >> beam.MapTuple(
                           lambda name, rs: write_store.write_rejects(run_uri, name, list(rs))))

    # Side inputs make the summary wait until every partition and reject file is written.
    _ = (p
         | "SummarySeed" >> beam.Create([None])
         | "Summary" >> beam.Map(lambda _, plan, w, r: write_store.write_summary(
             run_uri, plan, w, r), plan=AsSingleton(plan), w=AsList(written),
             r=AsList(rejects_written)))
