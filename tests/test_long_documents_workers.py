"""Long documents through real worker processes: HF parity of every stored token, a
2-process jax.distributed replica and a SIGKILL in the middle of a long document, each
byte-identical to one uninterrupted process.

Documents cross stored objects, host slices and partitions, so the hosts and partitions
that start inside a document warm their slot's cache up with its earlier rows.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from actx.schemas import commit, store
from tests import hf_models, token_runs, worker_procs

HOOKS = "embed,layers.*.resid_post,layers.1.attn_out,layers.2.mlp_out,final_norm"
MAX_CONTEXT = 48


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return hf_models.make_tiny_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama3")


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    run = str(tmp_path_factory.mktemp("ref") / "run")
    _, docs = token_runs.write_long_document_run(run, str(model_dir), hooks=HOOKS,
                                                 max_context=MAX_CONTEXT)
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "4"], devices=2)
    assert code == 0, out
    # Each marker records the tokens its rows were computed on: rows through slots in
    # successive steps, warm-up rows of other partitions left out.
    assert worker_procs.assert_markers_record_the_tokens(run) >= 3
    return run, docs


_copy_tokens = worker_procs.copy_token_store
_assert_identical = worker_procs.assert_same_activations


def test_every_stored_token_equals_hf_on_its_document(reference, model_dir):
    run, docs = reference
    s = store.open_store(run)
    n_parts = len(commit.committed_partitions(s))
    assert n_parts >= 3
    hf = hf_models.load_hf_model(model_dir)
    doc_index = token_runs.read_tokens(run, "doc_index")
    positions = token_runs.read_tokens(run, "positions")
    context_start = token_runs.read_tokens(run, "context_start")
    stored = {h: token_runs.read_activation(run, h) for h in
              ("embed", "layers.0.resid_post", "layers.2.resid_post", "layers.1.attn_out",
               "layers.2.mlp_out", "final_norm")}
    for d, ids in enumerate(docs):
        where = np.nonzero(doc_index == d)
        order = np.argsort(positions[where])
        rows, cols = where[0][order], where[1][order]
        np.testing.assert_array_equal(context_start[rows, cols],
                                      np.maximum(0, np.arange(len(ids)) - MAX_CONTEXT + 1))
        mask = hf_models.band_mask(len(ids), MAX_CONTEXT) if len(ids) > MAX_CONTEXT else None
        ref = hf_models.hf_hooks(hf, ids[None], attention_mask=mask)
        for hook, acts in stored.items():
            worker_procs.assert_close(acts[rows, cols], ref[hook][0], 1e-5,
                                      f"document {d} ({len(ids)} tokens) {hook}")


def test_two_host_replica_is_byte_identical(reference, tmp_path):
    ref, _ = reference
    run = _copy_tokens(ref, str(tmp_path / "run"))
    for code, out in worker_procs.run_replica(run, hosts=2, devices_per_host=1,
                                              extra=["--batch-size", "4"]):
        assert code == 0, out
    _assert_identical(run, ref)
    # Each host's blocks' token checksums, gathered on the leader in row order.
    assert worker_procs.assert_markers_record_the_tokens(run) >= 3


def test_sigkill_inside_a_long_document_then_rerun_is_byte_identical(reference, tmp_path):
    ref, _ = reference
    run = _copy_tokens(ref, str(tmp_path / "run"))
    # Step 6 is inside partition 1, where the 12-row document is in a slot.
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "4"], devices=2,
                                        ACTX_CRASH_AT="step:6")
    assert code == -9, out
    s = store.open_store(run)
    assert len(commit.committed_partitions(s)) < len(commit.committed_partitions(
        store.open_store(ref)))
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "4"], devices=2)
    assert code == 0, out
    _assert_identical(run, ref)


def test_reader_selects_tokens_that_saw_their_whole_document(reference):
    from actx import reader

    run, docs = reference
    sel = reader.open_run(run).select(["layers.2.resid_post"], whole_document=True)
    context_start = token_runs.read_tokens(run, "context_start")
    want_rows, want_cols = np.nonzero(context_start == 0)
    np.testing.assert_array_equal(sel.rows, want_rows)
    np.testing.assert_array_equal(sel.cols, want_cols)
    stored = token_runs.read_activation(run, "layers.2.resid_post")
    np.testing.assert_array_equal(sel.acts["layers.2.resid_post"], stored[want_rows, want_cols])
    # Every document longer than max_context leaves tokens out; no shorter one does.
    total = sum(len(d) for d in docs)
    assert len(sel) == total - sum(max(0, len(d) - MAX_CONTEXT) for d in docs) < total
    m = store.open_store(run)
    from actx.schemas import manifest
    assert sum(p.full_context_tokens for p in manifest.read_manifest(m).partitions) == len(sel)


def test_a_run_prepared_before_context_was_recorded_is_refused(reference, tmp_path):
    """An old run.json (spec_version 1) and an old token store (no tokens/context_start)
    are both refused with the missing field named, by workers and by the reader."""
    import json

    from actx import reader
    from actx.schemas import worker_options
    from actx.workers.loop import admission, runner

    ref, _ = reference
    old_spec = _copy_tokens(ref, str(tmp_path / "old_spec"))
    path = os.path.join(old_spec, "run.json")
    data = json.load(open(path))
    data["spec_version"] = 1
    del data["packing"]["max_context"]
    json.dump(data, open(path, "w"))
    for open_it in (lambda: runner.Worker(worker_options.WorkerOptions(run=old_spec)),
                    lambda: reader.open_run(old_spec)):
        with pytest.raises(Exception, match="no packing.max_context"):
            open_it()

    old_tokens = _copy_tokens(ref, str(tmp_path / "old_tokens"))
    shutil.rmtree(os.path.join(old_tokens, "tokens", "context_start"))
    with pytest.raises(admission.RunMismatch, match="tokens/context_start: missing"):
        runner.Worker(worker_options.WorkerOptions(run=old_tokens))


def test_max_context_beyond_the_model_is_refused(model_dir, tmp_path):
    from actx.schemas import worker_options
    from actx.workers.loop import runner

    run = str(tmp_path / "run")
    token_runs.write_long_document_run(run, str(model_dir), max_context=8192)
    with pytest.raises(ValueError, match="max_context=8192 is larger than the model's "
                                         "max_position_embeddings=4096"):
        runner.Worker(worker_options.WorkerOptions(run=run))


def test_a_cache_that_does_not_fit_the_chip_is_refused_with_figures():
    from actx.workers.attention import kv_cache

    kv_cache.check_fits(4 << 30, 8 << 30, 1 << 30, 16 << 30, max_context=4096,
                        slots_per_device=8, layers_run=32, device_kind="TPU v5 lite")
    kv_cache.check_fits(64 << 30, 8 << 30, 1 << 30, None, max_context=4096,
                        slots_per_device=8, layers_run=32, device_kind="cpu")  # no figure
    with pytest.raises(ValueError, match=r"needs 9\.00 GiB per device .* 4\.00 GiB of weights"
                                         r" and 1\.50 GiB .* 16\.00 GiB of one TPU v5 lite"):
        kv_cache.check_fits(9 << 30, 4 << 30, 3 << 29, 16 << 30, max_context=8192,
                            slots_per_device=8, layers_run=32, device_kind="TPU v5 lite")
    # Llama-3.1-8B-like at 8 slots x 4096 tokens of bfloat16: 0.5 GiB a slot, 4 GiB in all.
    from actx.workers.model.config import ModelConfig
    llama8b = ModelConfig("LlamaForCausalLM", 32, 4096, 128256, 32, 8, 128, 14336)
    assert kv_cache.cache_bytes(llama8b, 32, 8, 4096, 2) == 4 << 30
    assert kv_cache.capacity_tokens(4096, 1024) == 4096
    assert kv_cache.capacity_tokens(4097, 1024) == 4096 and kv_cache.capacity_tokens(20, 8) == 24


def test_prepare_refuses_max_context_beyond_the_model_before_any_work(model_dir, tmp_path):
    from actx.pipeline import main as prepare_main, prepare_refusals
    from actx.schemas import runspec

    spec = runspec.RunSpec.from_dict({
        "model": {"path": str(model_dir)}, "tokenizer": {"path": "unused"},
        "sources": [{"kind": "text", "paths": [str(tmp_path / "none.jsonl")]}],
        "packing": {"seq_len": 16, "max_context": 8192}})
    with pytest.raises(prepare_refusals.PrepareError,
                       match="max_context=8192 is larger than the model's "
                             "max_position_embeddings=4096"):
        prepare_main.run_prepare(spec, str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run")


def test_training_streams_can_keep_only_tokens_that_saw_their_whole_document(reference):
    """run.stream and run.batches with whole_document=True yield exactly the tokens whose
    context_start is 0, each once per epoch, with their stored values."""
    from actx import reader

    run, _ = reference
    context_start = token_runs.read_tokens(run, "context_start")
    stored = token_runs.read_activation(run, "layers.2.resid_post")
    want = set(zip(*np.nonzero(context_start == 0)))
    r = reader.open_run(run)
    for make in (lambda: r.stream("layers.2.resid_post", 32, whole_document=True,
                                  drop_last=False, buffer_tokens=4 * 16 * 4, prefetch=0),
                 lambda: r.batches("layers.2.resid_post", 32, whole_document=True,
                                   drop_last=False, prefetch=0)):
        seen = []
        with make() as batches:
            for b in batches:
                np.testing.assert_array_equal(b.acts["layers.2.resid_post"],
                                              stored[b.rows, b.cols])
                seen += list(zip(b.rows.tolist(), b.cols.tolist()))
        assert len(seen) == len(set(seen)) and set(seen) == want


def test_a_short_warm_up_is_exact_when_the_windows_allow_it(model_dir, tmp_path):
    """max_context 16 (one row) over 3 layers: values depend on at most 3 x 15 tokens
    before them, so a partition that starts inside a document re-runs only its last 3 rows
    (not all of them) and every token still equals HF with the window, one process and a
    2-host replica alike."""
    from actx.workers.loop import schedule

    run = str(tmp_path / "run")
    _, docs = token_runs.write_long_document_run(run, str(model_dir), hooks=HOOKS,
                                                 max_context=16)
    # The 12-row document (rows 12-23) enters partition 1 (rows 16-31) 4 rows in.
    positions = token_runs.read_tokens(run, "positions")
    segments = token_runs.read_tokens(run, "segment_ids")
    flags = (segments[16:32, 0] > 0) & (positions[16:32, 0] > 0)
    full = schedule.chains(16, 32, flags, positions[16:32, 0], 16)
    capped = schedule.chains(16, 32, flags, positions[16:32, 0], 16,
                             schedule.warmup_rows([16, 16, 16], 16))
    assert (full[0].warmup, capped[0].warmup) == (4, 3)
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "4"], devices=2)
    assert code == 0, out
    hf = hf_models.load_hf_model(model_dir)
    doc_index = token_runs.read_tokens(run, "doc_index")
    stored = token_runs.read_activation(run, "layers.2.resid_post")
    for d, ids in enumerate(docs):
        where = np.nonzero(doc_index == d)
        order = np.argsort(positions[where])
        rows, cols = where[0][order], where[1][order]
        mask = hf_models.band_mask(len(ids), 16) if len(ids) > 16 else None
        ref = hf_models.hf_hooks(hf, ids[None], attention_mask=mask)
        worker_procs.assert_close(stored[rows, cols], ref["layers.2.resid_post"][0], 1e-5,
                                  f"document {d} ({len(ids)} tokens)")
    replica = _copy_tokens(run, str(tmp_path / "replica"))
    for code, out in worker_procs.run_replica(replica, hosts=2, devices_per_host=1,
                                              extra=["--batch-size", "4"]):
        assert code == 0, out
    _assert_identical(replica, run)
