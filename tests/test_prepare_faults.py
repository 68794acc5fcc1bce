"""Prepare's bad inputs and failed attempts: a failed prepare leaves nothing a retry trips
on, rejects/ describe only the attempt that produced the manifest, empty inputs are an
error naming the source, and the reject abort says exactly what to type."""

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import yaml

from actx.pipeline import main, prepare_refusals
from actx.schemas import layout, runspec as R, store

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _texts(n, prefix="doc"):
    return [f"{prefix} {i} " + "word " * (3 + i % 5) for i in range(n)]


def _write_jsonl(path, texts, bad_lines=0):
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
        for _ in range(bad_lines):
            f.write("not json\n")
    return path


def _spec(tok, path):
    return R.RunSpec(R.ModelSpec(""), R.TokenizerSpec(tok, add_eos=True),
                     (R.SourceSpec("text", (path,), name="t"),),
                     packing=R.PackingSpec("segmented", 16),
                     layout=R.LayoutSpec(rows_per_shard=2, partition_rows=4))


def _tokens(run):
    from actx.schemas import ts_context, uri

    loc = uri.parse(run)
    return {n: ts_context.open_array({"driver": "zarr3", "kvstore": loc.join(
        layout.token_array_key(n)).kvstore()}).read().result() for n in layout.TOKEN_ARRAYS}


def _keys(run):
    return store.open_store(run).list()


@pytest.fixture(params=["local", "gcs"])
def run_dir(request, tmp_path):
    if request.param == "gcs":
        return request.getfixturevalue("gcs_bucket") + "/runs/retry"
    return str(tmp_path / "run")


def test_retry_after_a_failed_prepare_equals_a_fresh_prepare(tmp_path, qwen_tokenizer_dir,
                                                             run_dir):
    """The failed attempt writes a larger token store and rejects; the retry with fixed
    inputs (fewer rows) succeeds, and its run directory equals one prepared fresh."""
    data = str(tmp_path / "in.jsonl")
    _write_jsonl(data, _texts(60), bad_lines=5)
    run = run_dir
    with pytest.raises(prepare_refusals.PrepareError, match="5 of 65 inputs rejected"):
        main.run_prepare(_spec(qwen_tokenizer_dir, data), run)
    left = _keys(run)  # the failed attempt wrote token shards and rejects
    assert any(k.startswith("tokens/") for k in left), left
    assert any(k.startswith("rejects/") for k in left), left

    _write_jsonl(data, _texts(9))  # fixed: no bad lines, and far fewer rows
    m = main.run_prepare(_spec(qwen_tokenizer_dir, data), run)
    fresh = str(tmp_path / "fresh")
    ref = main.run_prepare(_spec(qwen_tokenizer_dir, data), fresh)
    assert m == ref and m.docs_rejected == 0
    assert _keys(run) == _keys(fresh)  # no rejects/ or docs of the failed attempt remain
    got, want = _tokens(run), _tokens(fresh)  # a text-only run has no ARC arrays
    for name in layout.TOKEN_ARRAYS:
        assert got[name].shape == want[name].shape and (got[name] == want[name]).all(), name


def test_rejects_describe_only_the_attempt_with_the_manifest(tmp_path, qwen_tokenizer_dir):
    data = str(tmp_path / "in.jsonl")
    _write_jsonl(data, _texts(20), bad_lines=2)
    run = str(tmp_path / "run")
    m1 = main.run_prepare(_spec(qwen_tokenizer_dir, data), run, max_reject_fraction=0.5)
    assert m1.docs_rejected == 2 and os.listdir(os.path.join(run, "rejects"))
    _write_jsonl(data, _texts(20))
    m2 = main.run_prepare(_spec(qwen_tokenizer_dir, data), run)
    assert m2.docs_rejected == 0
    assert not os.path.exists(os.path.join(run, "rejects")) or not os.listdir(
        os.path.join(run, "rejects"))


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "actx.deploy.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO})


def test_empty_input_is_an_error_naming_the_source(tmp_path, qwen_tokenizer_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = _cli("prepare", "--out", str(tmp_path / "run"), "--tokenizer", qwen_tokenizer_dir,
                "--text", str(empty), "--runner=FnApiRunner", cwd=str(tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"source 'text0': no documents in {empty} (empty input)" in proc.stdout
    assert not os.path.exists(tmp_path / "run" / "manifest.json")


def test_reject_abort_prints_the_command_that_passes(tmp_path, qwen_tokenizer_dir):
    """The printed command, run as printed, prepares the run (exit 0) with the rejects."""
    data = _write_jsonl(str(tmp_path / "in.jsonl"), _texts(10), bad_lines=1)
    run = str(tmp_path / "run")
    args = ["prepare", "--out", run, "--tokenizer", qwen_tokenizer_dir, "--text", data,
            "--seq-len", "16", "--max-reject-fraction", "0.05", "--runner=FnApiRunner"]
    proc = _cli(*args, cwd=str(tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "1 of 11 inputs rejected (9.1%), more than --max-reject-fraction=0.05" in proc.stdout
    hint = proc.stdout.strip().splitlines()[-1].strip()
    expected = ["actx", *args[:-3], "--runner=FnApiRunner", "--max-reject-fraction=0.091"]
    assert hint.split() == expected
    proc = _cli(*hint.split()[1:], cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 rejected" in proc.stdout
    with open(os.path.join(run, "manifest.json")) as f:
        assert json.load(f)["sources"]["text0"]["rejected"] == 1


def test_submit_takes_max_reject_fraction_and_its_hint_passes(tmp_path, qwen_tokenizer_dir):
    """`actx submit` aborts with the command to type; typed as printed, it prepares with
    the reject recorded and extracts every partition."""
    from actx.deploy import cli
    from tests import hf_models

    model = hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", num_hidden_layers=1,
                                           vocab_size=151936)
    data = _write_jsonl(str(tmp_path / "in.jsonl"), _texts(10), bad_lines=1)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "run": str(tmp_path / "run"),
        "spec": {"name": "rej", "model": {"path": str(model), "dtype": "float32"},
                 "tokenizer": {"path": qwen_tokenizer_dir},
                 "sources": [{"kind": "text", "name": "t", "paths": [data]}],
                 "packing": {"mode": "segmented", "seq_len": 32},
                 "capture": {"hooks": "layers.0.resid_post"},
                 "layout": {"rows_per_shard": 2, "partition_rows": 4}},
        "target": {"kind": "local", "hosts": 1, "batch_size": 2}}))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli.main(["submit", str(cfg), "--max-reject-fraction", "0.02"],
                        out=io.StringIO()) == 2
    hint = err.getvalue().strip().splitlines()[-1].strip()
    assert hint == f"actx submit {cfg} --max-reject-fraction=0.091", err.getvalue()
    out = io.StringIO()
    assert cli.main(hint.split()[1:], out=out) == 0, out.getvalue()
    assert ", 1 rejected" in out.getvalue()
    with open(tmp_path / "run" / "manifest.json") as f:
        manifest = json.load(f)
    n = len(manifest["partitions"]["id"])
    assert manifest["sources"]["t"]["rejected"] == 1
    assert f"partitions: {n} total | {n} committed" in out.getvalue()


def test_files_no_prepare_wrote_are_refused_not_deleted(tmp_path, qwen_tokenizer_dir):
    data = _write_jsonl(str(tmp_path / "in.jsonl"), _texts(5))
    run = tmp_path / "mydata"
    (run / "docs").mkdir(parents=True)
    (run / "docs" / "notes.txt").write_text("mine")
    with pytest.raises(prepare_refusals.PrepareError, match="holds docs/ that no actx prepare wrote"):
        main.run_prepare(_spec(qwen_tokenizer_dir, data), str(run))
    assert (run / "docs" / "notes.txt").read_text() == "mine"
