"""The prepare pipeline as Beam transforms: read → tokenize → plan → write partitions.

Determinism: documents are read, rendered and tokenized in parallel, each keyed by its
sort key (source index, file, line/row, variant). One global step collects only the small
metadata (key, token count, task id) and builds the run plan (`pipeline.partition`):
document order, packing and partitions are a pure function of those keys and counts, never
of bundle or worker order. Documents are then routed to the partitions they touch
(GroupByKey on partition id) and each partition is filled and written by one DoFn call,
sorting its documents by plan index. So the arrays and the doc tables are byte-identical
whatever the runner, its worker count or its running mode.
"""

from __future__ import annotations

import logging
import time

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.pvalue import AsList, AsSingleton

from pipeline import partition as partition_lib
from pipeline import sources
from pipeline import tokenize
from pipeline import write_store
from schemas import runspec as runspec_lib

NAMESPACE = "actx.prepare"
REJECTS_TAG = "rejects"
ARC_TAG = "arc"
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


class ReadFileFn(beam.DoFn):
    """(source_index, path) → TextRecord (main), ArcTaskRecord ('arc'), Reject ('rejects')."""

    def __init__(self, spec: runspec_lib.RunSpec):
        self.spec = spec
        self.read = Metrics.counter(NAMESPACE, "records_read")
        self.rejected = Metrics.counter(NAMESPACE, "records_rejected")

    def process(self, element):
        source_index, path = element
        source = self.spec.sources[source_index]
        for record in sources.read_file(source_index, source, self.spec.source_name(source_index),
                                        path, limit=source.max_docs):
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


class WritePartitionFn(beam.DoFn):
    """(partition_id, [TokenizedDoc]) → written stats; one call writes one shard object."""

    def __init__(self, spec: runspec_lib.RunSpec, run_uri: str):
        self.spec, self.run_uri = spec, run_uri
        self.partitions = Metrics.counter(NAMESPACE, "partitions_written")

    def setup(self):
        self.progress = _Progress("partitions written")

    def process(self, element, plan):
        partition_id, docs = element
        stats = write_store.write_partition(self.run_uri, self.spec, plan, partition_id,
                                            list(docs))
        self.partitions.inc()
        self.progress.add(1, f"of {len(plan.partitions)}")
        yield stats


def _to_partitions(doc: tokenize.TokenizedDoc, plan: partition_lib.RunPlan):
    index = plan.doc_index.get(doc.key)
    if index is None:  # beyond a source's max_docs
        return
    for pid in plan.partitions_of_doc(index):
        yield pid, doc


def build(p: beam.Pipeline, spec: runspec_lib.RunSpec, run_uri: str,
          files: list[tuple[int, str]], separator_id: int | None) -> None:
    """Adds the prepare transforms to `p`; `files` are (source_index, path), pre-expanded."""
    read = (p
            | "Files" >> beam.Create(files)
            | "SpreadFiles" >> beam.Reshuffle()
            | "Read" >> beam.ParDo(ReadFileFn(spec)).with_outputs(REJECTS_TAG, ARC_TAG,
                                                                  main="text"))
    variants = read[ARC_TAG] | "ArcVariants" >> beam.FlatMap(
        lambda rec: tokenize.expand_arc_variants(rec, spec.sources[rec.source_index]))
    docs = ((read.text, variants)
            | "Documents" >> beam.Flatten()
            | "Batch" >> beam.BatchElements(min_batch_size=8, max_batch_size=256)
            | "Tokenize" >> beam.ParDo(TokenizeFn(spec)))

    metas = (docs
             | "Meta" >> beam.Map(lambda d: partition_lib.DocMeta(d.key, len(d.token_ids),
                                                                  d.task_id))
             | "AllMeta" >> beam.combiners.ToList())
    reject_keys = (read[REJECTS_TAG]
                   | "RejectKeys" >> beam.Map(lambda r: r.record_key)
                   | "AllRejectKeys" >> beam.combiners.ToList())
    plan = (metas
            | "Plan" >> beam.Map(lambda m, rk: partition_lib.build_plan(spec, m, rk, separator_id),
                                 rk=AsSingleton(reject_keys))
            | "CreateArrays" >> beam.Map(lambda pl: write_store.create_token_arrays(
                run_uri, pl, spec)))

    written = (docs
               | "ToPartitions" >> beam.FlatMap(_to_partitions, plan=AsSingleton(plan))
               | "GroupPartitions" >> beam.GroupByKey()
               | "WritePartitions" >> beam.ParDo(WritePartitionFn(spec, run_uri),
                                                 plan=AsSingleton(plan)))

    def kept_rejects(r, plan):
        if plan.keeps_record(r.record_key):
            yield r.source, r

    rejects_written = (read[REJECTS_TAG]
                       | "KeepRejects" >> beam.FlatMap(kept_rejects, plan=AsSingleton(plan))
                       | "GroupRejects" >> beam.GroupByKey()
                       | "WriteRejects" >> beam.MapTuple(
                           lambda name, rs: write_store.write_rejects(run_uri, name, list(rs))))

    # Side inputs make the summary wait until every partition and reject file is written.
    _ = (p
         | "SummarySeed" >> beam.Create([None])
         | "Summary" >> beam.Map(lambda _, plan, w, r: write_store.write_summary(
             run_uri, plan, w, r), plan=AsSingleton(plan), w=AsList(written),
             r=AsList(rejects_written)))
