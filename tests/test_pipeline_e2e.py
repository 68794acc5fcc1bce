"""End-to-end prepare runs: local disk and fake-gcs-server, each packing mode, rejects,
determinism across running modes, and errors raised before any work starts."""

import dataclasses
import json
import os

import numpy as np
import pytest
import zarr
from tokenizers import Tokenizer

from actx.pipeline import fileio, main, prepare_refusals, sample_data, tokenize, write_store
from actx.schemas import layout, manifest as manifest_lib, runspec as R, store as store_lib

ARC_TASK = {"train": [{"input": [[1, 2], [3, 4]], "output": [[4, 3], [2, 1]]}],
            "test": [{"input": [[5, 6], [7, 8]], "output": [[8, 7], [6, 5]]}]}


def _inputs(root):
    fw = sample_data.make_fineweb_parquet(os.path.join(root, "fw", "000.parquet"), 30, seed=2)
    sample_data.make_fineweb_parquet(os.path.join(root, "fw", "001.parquet"), 10, seed=3)
    text = os.path.join(root, "text.jsonl")
    with open(text, "w") as f:
        f.write('{"text": "A short document."}\n{"text": 3}\n{"text": "Another one, longer than'
                ' the first, with digits 12345."}\nnot json\n')
    arc = os.path.join(root, "arc.jsonl")
    with open(arc, "w") as f:
        f.write(json.dumps({"task_id": "t-one", **ARC_TASK}) + "\n")
        f.write(json.dumps({"task_id": "t-bad", **ARC_TASK, "test": [{"input": [[1, 2], [3]]}]}) + "\n")
    return os.path.dirname(fw), text, arc


def _spec(tok_dir, fw, text, arc, mode="segmented", seq_len=64, **packing):
    return R.RunSpec(
        R.ModelSpec(""), R.TokenizerSpec(tok_dir, add_eos=True),
        (R.SourceSpec("fineweb", (fw + "/*.parquet",), name="fw"),
         R.SourceSpec("text", (text,), name="misc"),
         R.SourceSpec("arc", (arc,), name="arc", arc_dihedral=True, arc_include_test_output=True)),
        packing=R.PackingSpec(mode, seq_len, **packing),
        layout=R.LayoutSpec(rows_per_shard=4, partition_rows=8))


def _arrays(run):
    """The token arrays of a run: its ARC arrays only where it has ARC sources."""
    return {n: zarr.open_array(os.path.join(run, "tokens", n), mode="r")[:]
            for n in layout.ALL_TOKEN_ARRAYS if os.path.isdir(os.path.join(run, "tokens", n))}


def _doc_table(run, manifest):
    rows = []
    for p in manifest.partitions:
        with open(os.path.join(run, layout.docs_key(p.id))) as f:
            rows += [json.loads(line) for line in f]
    return rows


def _tree(run):
    out = {}
    for d, _, files in os.walk(run):
        for name in files:
            rel = os.path.relpath(os.path.join(d, name), run)
            with open(os.path.join(d, name), "rb") as f:
                out[rel] = f.read()
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, qwen_tokenizer_dir):
    root = str(tmp_path_factory.mktemp("e2e"))
    fw, text, arc = _inputs(root)
    spec = _spec(qwen_tokenizer_dir, fw, text, arc)
    run = os.path.join(root, "run")
    manifest = main.run_prepare(spec, run, max_reject_fraction=0.2)
    return spec, run, manifest, (fw, text, arc), root


def test_manifest_accounting_and_partitions(prepared):
    spec, run, manifest, _, _ = prepared
    assert manifest_lib.read_manifest(store_lib.open_store(run)) == manifest
    assert store_lib.open_store(run).read_json("run.json")["fingerprint"] == spec.fingerprint
    counts = {name: dataclasses.replace(c, reasons={}) for name, c in manifest.sources.items()}
    assert counts["fw"] == manifest_lib.SourceCounts(40, 40, 0, 0)
    assert counts["misc"] == manifest_lib.SourceCounts(4, 2, 2, 0)
    assert counts["arc"] == manifest_lib.SourceCounts(2, 1, 1, 0)
    # The reasons, by kind, count every reject (the rejects/ files hold each one).
    for c in manifest.sources.values():
        assert sum(c.reasons.values()) == c.rejected
    assert manifest.docs_read == manifest.docs_accepted + manifest.docs_rejected
    assert manifest.arc_tasks == ("t-one",) and manifest.eos_id == 151643
    assert manifest.bos_id is None and 151644 in manifest.special_token_ids
    assert manifest.vocab_size == 151665 and manifest.fingerprint == spec.fingerprint
    start = 0
    for i, p in enumerate(manifest.partitions):
        assert p.id == i and p.row_start == start
        assert p.row_count == 8 or i == len(manifest.partitions) - 1
        start = p.row_stop
    assert start == manifest.total_rows
    assert sum(p.docs for p in manifest.partitions) == 40 + 2 + 8
    assert manifest.version == 4


def test_manifest_records_each_partitions_longest_document_run(prepared):
    """`longest_doc_rows`, against the stored doc_index: the most consecutive rows of the
    partition one document appears in (documents here run up to several 64-token rows);
    `continued_doc_rows` and `continued_from_rows`: the rows of a document continued from
    the partition before, in the partition and before it."""
    _, run, manifest, _, _ = prepared
    doc_index = _arrays(run)["doc_index"]
    longest_overall = continued = 0
    for p in manifest.partitions:
        rows_of = {}  # document -> the partition's rows it appears in
        for row in range(p.row_start, p.row_stop):
            for d in set(doc_index[row].tolist()) - {-1}:
                rows_of.setdefault(d, []).append(row)
        runs = []
        for rows in rows_of.values():
            assert rows == list(range(rows[0], rows[-1] + 1))  # a document's rows are adjacent
            runs.append(len(rows))
        assert p.longest_doc_rows == max(runs), (p, sorted(runs))
        longest_overall = max(longest_overall, p.longest_doc_rows)
        # A document of the partition before that goes on into its first row: its rows
        # here and before (where a worker's warm-up comes from).
        first = int(doc_index[p.row_start, 0])
        before = 0
        while (first >= 0 and p.row_start - before > 0
               and first in doc_index[p.row_start - before - 1]):
            before += 1
        expected = (len(rows_of[first]), before) if before else (0, 0)
        assert (p.continued_doc_rows, p.continued_from_rows) == expected, p
        continued += bool(before)
    assert longest_overall >= 3  # the check sees documents of several rows
    assert continued >= 1  # and a document continued from the partition before


def test_token_arrays_match_independent_tokenization(prepared):
    spec, run, manifest, _, _ = prepared
    arrays = _arrays(run)
    assert arrays["input_ids"].shape == (manifest.total_rows, 64)
    assert int((arrays["segment_ids"] > 0).sum()) == manifest.total_tokens
    tok = Tokenizer.from_file(os.path.join(spec.tokenizer.path, "tokenizer.json"))
    texts = {r["id"]: r["text"] for s in (2, 3) for r in sample_data.make_fineweb_rows(
        30 if s == 2 else 10, seed=s)}
    docs = _doc_table(run, manifest)
    assert [d["doc_index"] for d in docs] == list(range(len(docs)))
    for d in docs:
        mask = arrays["doc_index"] == d["doc_index"]
        ids = arrays["input_ids"][mask]  # row-major = document order
        assert len(ids) == d["n_tokens"]
        assert arrays["input_ids"][d["first_row"], d["first_col"]] == ids[0]
        assert list(arrays["positions"][mask]) == list(range(d["n_tokens"]))
        if d["source"] == "fw":
            expect = tok.encode(texts[d["doc_id"]], add_special_tokens=False).ids + [151643]
            assert ids.tolist() == expect
            assert d["url"].startswith("https://example.org/") and d["dump"].startswith("CC-MAIN")
    assert (arrays["doc_index"][arrays["segment_ids"] == 0] == -1).all()
    fw_rows = arrays["doc_index"] < 40
    assert (arrays["arc_task"][fw_rows] == -1).all()


def test_arc_provenance_selects_test_input_cells(prepared):
    _, run, manifest, _, _ = prepared
    arrays = _arrays(run)
    docs = [d for d in _doc_table(run, manifest) if d["source"] == "arc"]
    assert [d["variant"] for d in docs] == list(range(8))
    assert docs[1]["transform"] == "rot90" and docs[0]["task_id"] == "t-one"
    test_input = layout.ARC_GRIDS.index("test_input")
    sel = (arrays["arc_grid"] == test_input) & (arrays["arc_row"] >= 0)
    assert sel.sum() == 8 * 4  # 8 variants x a 2x2 test input
    tok = Tokenizer.from_file(os.path.join(prepared[0].tokenizer.path, "tokenizer.json"))
    from actx.pipeline import arc_render
    for r, c in zip(*np.nonzero(sel)):
        variant = arc_render.variants("t-one", True, 0, 0)[arrays["arc_variant"][r, c]]
        grid = arc_render.transform_grid(ARC_TASK["test"][0]["input"], variant)
        cell = grid[arrays["arc_row"][r, c]][arrays["arc_col"][r, c]]
        assert tok.decode([int(arrays["input_ids"][r, c])]) == str(cell)
        assert arrays["arc_part"][r, c] == layout.ARC_PARTS.index("user")


def test_rejects_written_with_reasons(prepared):
    _, run, _, (fw, text, arc), _ = prepared
    with open(os.path.join(run, write_store.rejects_key("misc"))) as f:
        misc = [json.loads(line) for line in f]
    assert [(r["line"], r["reason"].split(" (")[0]) for r in misc] == [
        (2, "text field 'text' is not a string"), (4, "malformed JSON: Expecting value at column 1")]
    assert misc[0]["file"] == text and misc[0]["source"] == "misc" and "snippet" in misc[0]
    with open(os.path.join(run, write_store.rejects_key("arc"))) as f:
        [bad] = [json.loads(line) for line in f]
    assert bad["line"] == 2 and "ragged" in bad["reason"]


def test_deterministic_across_running_modes(prepared):
    spec, run, _, _, root = prepared
    other = os.path.join(root, "run-mp")
    main.run_prepare(spec, other, ["--direct_num_workers=2",
                                   "--direct_running_mode=multi_processing"], 0.2)
    assert _tree(run) == _tree(other)  # every byte: arrays, doc tables, rejects, manifest


def test_deterministic_with_the_bundle_based_runner_and_small_units(prepared):
    """Beam's other local runner, and work units of 2 KB instead of one per file, give the
    same bytes."""
    spec, run, _, _, root = prepared
    other = os.path.join(root, "run-bundle")
    main.run_prepare(spec, other, ["--runner=BundleBasedDirectRunner"], 0.2, unit_bytes=2000)
    assert _tree(run) == _tree(other)


def test_pad_via_cli_and_concat(prepared, qwen_tokenizer_dir, capsys):
    _, _, _, (fw, _, _), root = prepared
    run = os.path.join(root, "run-pad")
    rc = main.main(["--out", run, "--tokenizer", qwen_tokenizer_dir, "--fineweb", fw,
                    "--mode", "pad", "--seq-len", "32", "--overflow", "truncate",
                    "--partition-rows", "16", "--direct_num_workers=2",
                    "--direct_running_mode=multi_threading"])
    assert rc == 0 and "prepared" in capsys.readouterr().out
    m = manifest_lib.read_manifest(store_lib.open_store(run))
    arrays = _arrays(run)
    assert set(arrays) == set(layout.TOKEN_ARRAYS)  # no ARC source: no ARC arrays
    assert m.total_rows == 40 and (arrays["segment_ids"] <= 1).all()
    assert (arrays["doc_index"][:, 0] == np.arange(40)).all()
    assert m.sources["fineweb0"].truncated_tokens > 0
    hf_tokenizer = Tokenizer.from_file(os.path.join(qwen_tokenizer_dir, "tokenizer.json"))
    assert m.total_tokens + m.sources["fineweb0"].truncated_tokens == sum(
        len(hf_tokenizer.encode(r["text"], add_special_tokens=False).ids)
        for s, n in ((2, 30), (3, 10)) for r in sample_data.make_fineweb_rows(n, s))

    spec = R.RunSpec(R.ModelSpec(""), R.TokenizerSpec(qwen_tokenizer_dir),
                     (R.SourceSpec("fineweb", (fw,), max_docs=12),),
                     packing=R.PackingSpec("concat", 48, separator="eos"),
                     layout=R.LayoutSpec(rows_per_shard=2, partition_rows=4))
    run = os.path.join(root, "run-concat")
    m = main.run_prepare(spec, run)
    arrays = _arrays(run)
    assert m.sources["fineweb0"].read == 12
    flat = arrays["input_ids"].reshape(-1)[:m.total_tokens]
    assert (arrays["segment_ids"].reshape(-1)[:m.total_tokens] > 0).all()  # no padding inside
    assert (flat == 151643).sum() == 11  # separators between 12 documents
    assert (arrays["positions"][0] == np.arange(48)).all()


def test_gcs_inputs_and_run_directory(prepared, gcs_bucket):
    spec, local_run, _, (fw, text, arc), _ = prepared
    bucket = store_lib.open_store(gcs_bucket)
    for path in (fw + "/000.parquet", fw + "/001.parquet", text, arc):
        with open(path, "rb") as f:
            bucket.write("in/" + os.path.relpath(path, os.path.dirname(fw)), f.read())
    gs_spec = R.RunSpec(spec.model, spec.tokenizer, (
        R.SourceSpec("fineweb", (f"{gcs_bucket}/in/fw/*.parquet",), name="fw"),
        R.SourceSpec("text", (f"{gcs_bucket}/in/text.jsonl",), name="misc"),
        R.SourceSpec("arc", (f"{gcs_bucket}/in/arc.jsonl",), name="arc", arc_dihedral=True,
                     arc_include_test_output=True)), spec.packing, layout=spec.layout)
    run = f"{gcs_bucket}/runs/r1"
    m = main.run_prepare(gs_spec, run, max_reject_fraction=0.2)
    store = store_lib.open_store(run)
    assert manifest_lib.read_manifest(store) == m and store.exists("run.json")
    assert store.exists(write_store.rejects_key("misc")) and store.exists(layout.docs_key(0))
    import tensorstore as ts
    from actx.schemas import uri
    gs_ids = ts.open(layout.token_array("input_ids", m.total_rows, 64, spec.layout).spec(
        uri.parse(run))).result().read().result()
    assert (gs_ids == _arrays(local_run)["input_ids"]).all()


def test_too_many_rejects_fails_with_summary(prepared, qwen_tokenizer_dir):
    _, _, _, (_, text, _), root = prepared
    spec = R.RunSpec(R.ModelSpec(""), R.TokenizerSpec(qwen_tokenizer_dir),
                     (R.SourceSpec("text", (text,)),))
    run = os.path.join(root, "run-rejects")
    with pytest.raises(prepare_refusals.PrepareError, match=r"(?s)2 of 4 inputs rejected .*malformed JSON: 1"):
        main.run_prepare(spec, run)
    assert not os.path.exists(os.path.join(run, "manifest.json"))
    assert os.path.exists(os.path.join(run, write_store.rejects_key("text0")))


def test_errors_before_work(tmp_path, qwen_tokenizer_dir):
    def spec(path, tok=qwen_tokenizer_dir):
        return R.RunSpec(R.ModelSpec(""), R.TokenizerSpec(tok), (R.SourceSpec("text", (path,)),))
    with pytest.raises(fileio.InputError, match="no such file"):
        main.run_prepare(spec(str(tmp_path / "nope.jsonl")), str(tmp_path / "r"))
    with pytest.raises(fileio.InputError, match="glob matches no files"):
        main.run_prepare(spec(str(tmp_path / "*.jsonl")), str(tmp_path / "r"))
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(tokenize.TokenizerError, match="tokenizer not found"):
        main.run_prepare(spec(str(tmp_path / "a.jsonl"), str(tmp_path)), str(tmp_path / "r"))
    assert not (tmp_path / "r").exists()
