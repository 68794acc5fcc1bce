"""What `actx status` (text, --json, the page) and the reader's `describe()` and
`generations()` say a generating run wrote: prompts, samples, generated tokens and why
each sample stopped, over the committed partitions only.

One real generating run (a real Beam prepare of prompts with the real Qwen vocabulary, a
real worker process on a tiny qwen2 checkpoint, as tests/test_generate_run.py builds it,
greedy with two samples per prompt); every count is checked against what is computed here
from the token store itself (the doc table, manifest.json and the ids the worker stored
in `generated.token_ids`), not from the records the code under test reads.
"""

from __future__ import annotations

import io
import json
import os
import shutil

import numpy as np
import pytest

from actx import reader
from actx.deploy import cli
from actx.deploy.page import data as ui_data
from actx.schemas import commit, layout, runspec, store
from tests import browser, generate_runs, page_checks, status_runs, token_runs

MAX_NEW = 24
SAMPLES = 2
HOOKS, STOP, PROMPTS = generate_runs.HOOKS, generate_runs.STOP, generate_runs.PROMPTS


@pytest.fixture(scope="module")
def generated(tmp_path_factory, qwen_tokenizer_dir) -> str:
    """The finished run (tests.generate_runs), greedy with two samples per prompt."""
    root = tmp_path_factory.mktemp("gen")
    spec = runspec.RunSpec.from_dict(generate_runs.spec_dict(
        generate_runs.tiny_qwen2(root / "qwen2"), qwen_tokenizer_dir,
        generate_runs.write_prompts(root / "prompts.jsonl"), max_new_tokens=MAX_NEW,
        samples_per_prompt=SAMPLES, stop_token_ids=[STOP]))
    run = str(root / "run")
    assert len(generate_runs.generated_run(run, spec).partitions) > 2
    return run


def _doc_table(run: str) -> dict[int, dict]:
    """{doc_index: its doc-table row, with the partition whose table lists it}."""
    s, out = store.open_store(run), {}
    for key in s.list(layout.DOCS_PREFIX):
        pid = int(key[len(layout.DOCS_PREFIX) + 2:].split(".")[0])
        for line in s.read(key).decode().splitlines():
            d = json.loads(line)
            out[d["doc_index"]] = {**d, "partition": pid}
    return out


def _written(run: str) -> dict[int, list[int]]:
    """{doc_index: the ids the model wrote, in order}, from tokens/ and
    activations/generated.token_ids (the stored ids, not the records)."""
    doc_index = token_runs.read_tokens(run, "doc_index")
    positions = token_runs.read_tokens(run, "positions")
    ids = token_runs.read_activation(run, layout.GENERATED_IDS)[..., 0]
    out = {}
    for d in sorted(set(np.unique(doc_index).tolist()) - {-1}):
        where = np.nonzero(doc_index == d)
        order = np.argsort(positions[where])
        written = ids[where][order]
        out[d] = written[written >= 0].tolist()
    return out


def _expected(run: str, committed: set[int]) -> dict:
    """The counts, from the doc table and the stored ids: the samples whose documents start
    in a committed partition (the one whose doc table lists them)."""
    docs = {d: row for d, row in _doc_table(run).items() if row["partition"] in committed}
    written = _written(run)
    reasons = {"stop_token": 0, "length": 0}
    for d in docs:
        ids = written[d]
        assert 1 <= len(ids) <= MAX_NEW
        stopped = ids[-1] == STOP
        assert stopped or len(ids) == MAX_NEW  # no other way to end
        reasons["stop_token" if stopped else "length"] += 1
    return {"prompts": len({d - row["sample"] for d, row in docs.items()}),
            "samples": len(docs), "generated_tokens": sum(len(written[d]) for d in docs),
            "stop_reasons": reasons, "partitions": len(committed), "unreadable": []}


def _status(run: str, *args: str) -> str:
    out = io.StringIO()
    assert cli.main(["status", run, *args], out=out) == 0
    return out.getvalue()


def _line(text: str, label: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith(label)]
    assert len(lines) == 1, text
    return lines[0]


def _generated_line(g: dict) -> str:
    return (f"generated:  {g['samples']} sample(s) of {g['prompts']} prompt(s), "
            f"{g['generated_tokens']} generated tokens; stopped by: stop_token "
            f"{g['stop_reasons']['stop_token']}, length {g['stop_reasons']['length']} "
            f"(records of {g['partitions']} committed partition(s))")


def test_status_and_describe_count_what_the_token_store_holds(generated):
    n_parts = len(json.load(open(os.path.join(generated, "manifest.json")))["partitions"]["id"])
    want = _expected(generated, set(range(n_parts)))
    manifest = json.load(open(os.path.join(generated, "manifest.json")))
    # Every prompt accepted, each as SAMPLES documents; both ways of stopping occur.
    assert want["prompts"] == manifest["totals"]["docs_accepted"] == len(PROMPTS)
    assert want["samples"] == SAMPLES * len(PROMPTS)
    assert all(want["stop_reasons"].values())

    st = json.loads(_status(generated, "--json"))
    assert st["identity"]["generation"] == want
    assert st["identity"]["generate"]["max_new_tokens"] == MAX_NEW
    assert set(st["identity"]["hooks"]) == set(HOOKS.split(","))  # the ids are no hook

    text = _status(generated)
    assert _line(text, "generated:") == _generated_line(want)
    settings = _line(text, "settings:")
    assert (f"stored as float32; generates up to {MAX_NEW} new tokens per sample (greedy), "
            f"{SAMPLES} sample(s) per prompt; seq_len 32" in settings)
    assert layout.GENERATED_IDS not in settings

    run = reader.open_run(generated)
    assert run.describe()["generation"] == want


def test_generations_are_the_samples_of_the_doc_table(generated):
    docs, written = _doc_table(generated), _written(generated)
    samples = reader.open_run(generated).generations()
    assert [s["doc_index"] for s in samples] == sorted(docs)
    for s in samples:
        d = docs[s["doc_index"]]
        assert (s["sample"], s["prompt_tokens"], s["partition"]) == (
            d["sample"], d["prompt_tokens"], d["partition"])
        assert s["prompt_doc"] == s["doc_index"] - d["sample"]
        assert s["generated_ids"] == written[s["doc_index"]]
        assert s["generated_tokens"] == len(written[s["doc_index"]])
    # Greedy: both samples of a prompt write the same text.
    by_prompt = {}
    for s in samples:
        by_prompt.setdefault(s["prompt_doc"], []).append(s["text"])
    assert all(len(t) == SAMPLES and len(set(t)) == 1 for t in by_prompt.values())
    one = reader.open_run(generated).generations(partitions=[0])
    assert one == [s for s in samples if s["partition"] == 0] and one


def test_only_committed_partitions_count_and_a_lost_record_is_named(generated, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(generated, run)
    docs = _doc_table(run)
    starts = sorted({d["partition"] for d in docs.values()})
    uncommitted, damaged = starts[1], starts[-1]  # both hold the start of some sample
    s = store.open_store(run)
    s.delete(layout.commit_key(uncommitted))
    committed = commit.committed_partitions(s)
    want = _expected(run, committed)
    assert want["samples"] < len(docs)

    st = json.loads(_status(run, "--json"))
    assert st["identity"]["generation"] == want and st["phase"] != "finished"
    opened = reader.open_run(run)
    assert opened.describe()["generation"] == want
    assert {x["doc_index"] for x in opened.generations()} == {
        d for d, row in docs.items() if row["partition"] in committed}
    with pytest.raises(reader.UncommittedPartitionError):
        opened.generations(partitions=[uncommitted])

    s.delete(layout.generated_key(damaged))  # damage: its marker stands without it
    counted = committed - {damaged}
    want = {**_expected(run, counted), "unreadable": [damaged]}
    st = json.loads(_status(run, "--json"))
    assert st["identity"]["generation"] == want
    assert _line(_status(run), "generated:") == (
        f"{_generated_line(want)}; 1 committed partition(s) without a readable generated/ "
        f"record, not counted: {layout.partition_name(damaged)}")
    opened = reader.open_run(run)
    assert opened.describe()["generation"] == want
    with pytest.raises(reader.ReaderError, match=layout.generated_key(damaged)):
        opened.generations()
    assert len(opened.generations(partitions=sorted(counted))) == want["samples"]


def test_a_poller_reads_each_record_once_while_its_partition_stays_committed(generated,
                                                                             tmp_path):
    """A status that polls one view of the run (a launcher's progress line, a follow, the
    page) reads the generated/ record of a partition once, not at every poll (at 100k
    partitions a poll every 5 s would read 20k records a second); a partition that leaves
    the committed set (a repair) and comes back is read again; the counts stay those of the
    committed partitions. A new view (another `actx status`) reads them all."""
    from actx.deploy.status import runstate
    from actx.schemas import run_dir

    run = str(tmp_path / "run")
    shutil.copytree(generated, run)
    handle = run_dir.RunDir.at(run).opened()
    read = []
    read_many = handle.store.read_many

    def counting(keys, *args, **kwargs):
        read.extend(k for k in keys if k.startswith(layout.GENERATED_PREFIX))
        return read_many(keys, *args, **kwargs)

    handle.store.read_many = counting
    s = store.open_store(run)
    committed = commit.committed_partitions(s)
    first = runstate.compute_status(handle).identity["generation"]
    assert first == _expected(run, committed)
    assert sorted(read) == sorted(layout.generated_key(p) for p in committed)
    read.clear()
    assert runstate.compute_status(handle).identity["generation"] == first
    assert read == []
    docs = _doc_table(run)
    gone = sorted({d["partition"] for d in docs.values()})[1]
    marker = s.read(layout.commit_key(gone))
    s.delete(layout.commit_key(gone))
    assert runstate.compute_status(handle).identity["generation"] == _expected(
        run, committed - {gone}) != first
    assert read == []
    s.write(layout.commit_key(gone), marker)
    assert runstate.compute_status(handle).identity["generation"] == first
    assert read == [layout.generated_key(gone)]
    read.clear()
    other = run_dir.RunDir.at(run).opened()
    read_many = other.store.read_many
    other.store.read_many = counting
    assert runstate.compute_status(other).identity["generation"] == first
    assert len(read) == len(committed)


def test_the_page_shows_what_status_says(generated, tmp_path):
    page_path = str(tmp_path / "page.html")
    assert cli.main(["status", generated, "--html", page_path], out=io.StringIO()) == 0
    st = page_checks.status_json(generated)
    manifest = json.load(open(os.path.join(generated, "manifest.json")))
    page = page_checks.check_page(browser.dump_dom(f"file://{page_path}"), st, manifest)
    text = _status(generated)
    assert f"; {page.text('id-generates')}; " in _line(text, "settings:")
    assert "generated:  " + page.text("id-generated") == _line(text, "generated:")
    assert layout.GENERATED_IDS not in page.text("id-hooks")


def test_a_run_that_does_not_generate_shows_nothing_new(reader_run, tmp_path):
    run = status_runs.write_local(str(tmp_path / "synthetic"), n_partitions=6, n_hosts=2,
                                  committed=3, dead_hosts=0, now=1e9)
    st = json.loads(_status(run, "--json"))
    assert "generate" not in st["identity"] and "generation" not in st["identity"]
    assert "generate" not in _status(run)
    assert ui_data.generation_facts(st["identity"]) == []
    opened = reader.open_run(reader_run.uri)
    assert opened.describe()["generation"] is None
    with pytest.raises(reader.ReaderError, match="does not generate"):
        opened.generations()
    # Asking to leave out a role such a run has not is refused, by the statistics as by
    # the stream (before, compute_stats counted every token and recorded the exclusion).
    hook = sorted(opened.hooks)[0]
    for exclude in (["prompt"], ["bos", "generated"]):
        with pytest.raises(ValueError, match=r"exclude: '(prompt|generated)' .* does not "
                                             r"generate"):
            opened.compute_stats([hook], exclude=exclude)
        with pytest.raises(ValueError, match="does not generate"):
            opened.stream(hook, batch_size=4, exclude=exclude)
    assert not os.path.exists(os.path.join(reader_run.uri, layout.STATS_KEY))
