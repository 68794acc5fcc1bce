"""Several extractions over one token store (schemas.extraction): two tiny Qwen2 models
with one tokenizer (the second a copy with other weights) extracted into one run, each
extraction byte-identical to a run of its model alone; a model added to a finished run;
a killed extraction rerun without touching the other; aligned batches (reader.aligned)
checked token for token against each extraction read alone.

Workers run in this process (8 CPU devices, batch 8) except the one that is killed, a real
process with the same devices, so every attempt shares one numerics key.
"""

from __future__ import annotations

import gc
import io
import json
import os

import numpy as np
import pytest
import torch

from actx.schemas import commit, extraction, extraction_store, layout, runspec, store
from tests import hf_models, token_runs, worker_procs

N_ROWS = 16
PARTITION_ROWS = 8  # 2 partitions of 1 step (batch 8); shards of 4 rows
HOOKS = "layers.*.resid_post"
LIVE_BYTES: list[int] = []  # device bytes alive as each extraction of `both` starts


def _extract(run: str, names: str = "", *flags: str) -> None:
    from actx.workers import main as worker_main

    argv = (["--run", run, "--batch-size", "8"] + (["--extraction", names] if names else [])
            + list(flags))
    assert worker_main.main(argv) == 0


def _add(run: str, name: str, model: str) -> None:
    s = store.open_store(run)
    root = runspec.read_run_spec(s)
    extraction.add(s, root, name, extraction.spec_for(
        root, runspec.ModelSpec(path=model, dtype="float32"), root.capture))


def _objects(run: str, name: str = "") -> dict[str, bytes]:
    """Stored activation objects of one extraction by key relative to it, actx.json aside
    (it records the attempt's numerics, the same here, and the extraction's fingerprint)."""
    prefix = layout.extraction_prefix(name)
    objects = worker_procs.stored_objects(run, prefix + "activations")
    return {k[len(prefix):]: v for k, v in objects.items() if not k.endswith("actx.json")}


def _checksums(run: str, name: str = "") -> dict[int, dict]:
    s = extraction_store.view(store.open_store(run), name)
    return {p: commit.read_marker(s, p).checksums for p in commit.committed_partitions(s)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    base = hf_models.make_tiny_checkpoint(root / "base", "qwen2", seed=0)
    chat = hf_models.make_tiny_checkpoint(root / "chat", "qwen2", seed=1)  # other weights
    return {"base": str(base), "chat": str(chat)}


@pytest.fixture(scope="module")
def alone(models, tmp_path_factory):
    """Each model extracted alone into a run of its own (the default extraction)."""
    runs = {}
    for name, model in models.items():
        run = str(tmp_path_factory.mktemp(f"alone-{name}") / "run")
        token_runs.write_token_run(run, model, n_rows=N_ROWS, hooks=HOOKS,
                                   partition_rows=PARTITION_ROWS)
        _extract(run)
        runs[name] = run
    return runs


@pytest.fixture(scope="module")
def both(models, tmp_path_factory):
    """One token store, extractions `base` and `chat`, extracted by one worker process one
    after the other."""
    run = str(tmp_path_factory.mktemp("both") / "run")
    token_runs.write_token_run(run, models["base"], n_rows=N_ROWS, hooks=HOOKS,
                               partition_rows=PARTITION_ROWS)
    for name, model in models.items():
        _add(run, name, model)
    import gc

    import jax

    from actx.workers import main as worker_main

    real = worker_main._extract

    def counting(opts, sigint, *opened):
        gc.collect()
        LIVE_BYTES.append(sum(a.nbytes for a in jax.live_arrays()))
        return real(opts, sigint, *opened)

    worker_main._extract = counting
    try:
        _extract(run, "base,chat")
    finally:
        worker_main._extract = real
    return run


def test_each_extraction_equals_its_model_alone(both, alone, models):
    # One model in memory at a time: base's weights were gone before chat's loaded.
    weights = os.path.getsize(os.path.join(models["base"], "model.safetensors"))
    assert len(LIVE_BYTES) == 2 and LIVE_BYTES[1] < LIVE_BYTES[0] + weights / 2, \
        LIVE_BYTES
    assert extraction_store.names(store.open_store(both)) == ["base", "chat"]  # no default
    for name in ("base", "chat"):
        assert _objects(both, name) == _objects(alone[name]), name
        assert _checksums(both, name) == _checksums(alone[name])
    assert _objects(both, "base") != _objects(both, "chat")  # two models, two results
    # The default extraction (the root) was not extracted; the token store is shared.
    assert not os.path.exists(os.path.join(both, "activations"))
    assert not os.path.exists(os.path.join(both, "commits"))
    info = json.load(open(os.path.join(both, "extractions", "chat", "activations",
                                       "actx.json")))
    chat_spec = runspec.read_run_spec(extraction_store.view(store.open_store(both), "chat"))
    assert info["fingerprint"] == chat_spec.fingerprint


def test_rerun_takes_the_extractions_in_the_order_they_were_launched(both, tmp_path):
    """A config that names `chat` before `base`: `actx rerun` takes them in that order (the
    launch record's), not alphabetically; an extraction the record does not name after."""
    import shutil

    from actx.deploy import cli, config, launch_record

    run = str(tmp_path / "run")
    shutil.copytree(both, run)
    launch_record.record(store.open_store(run), config.TargetConfig(), "j",
                         extractions=["chat", "base"])
    out = io.StringIO()
    assert cli.main(["rerun", run], out=out) == 0, out.getvalue()
    assert "rerun: extractions chat, base of " in out.getvalue(), out.getvalue()
    launch_record.record(store.open_store(run), config.TargetConfig(), "k",
                         extractions=["chat"])
    assert launch_record.in_launch_order(store.open_store(run), ["base", "chat", ""]) == \
        ["chat", "base", ""]


def _beats(run: str, name: str) -> list[dict]:
    """The heartbeats of extraction `name` as they stand."""
    view = extraction_store.view(store.open_store(run), name)
    return [view.read_json(k) for k in view.list("workers/") if k.endswith(".json")]


def _two_models_run(models, tmp_path) -> str:
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, models["base"], n_rows=N_ROWS, hooks=HOOKS,
                               partition_rows=PARTITION_ROWS)
    for name, model in models.items():
        _add(run, name, model)
    return run


def test_two_models_at_once_equal_each_alone(models, alone, tmp_path, monkeypatch):
    """`--models-at-once 2`: both models in memory together (chat loads while base's
    weights are alive), both loops running at the same time on their own threads, and
    each extraction byte for byte its model alone."""
    import threading
    import time

    import jax

    from actx.workers import main as worker_main

    run = _two_models_run(models, tmp_path)
    live, spans, waiting = [], {}, []
    real_load, real_run = worker_main._load, worker_main._run

    def load(opts, sigint, *opened):
        gc.collect()
        live.append(sum(a.nbytes for a in jax.live_arrays()))
        if opts.extraction == "chat":  # base, loaded, beats while chat loads beside it
            waiting.extend(_beats(run, "base"))
        return real_load(opts, sigint, *opened)

    def run_loop(worker, sigint):
        start = time.monotonic()
        try:
            return real_run(worker, sigint)
        finally:
            spans[worker.extraction] = (start, time.monotonic(),
                                        threading.current_thread().name)

    monkeypatch.setattr(worker_main, "_load", load)
    monkeypatch.setattr(worker_main, "_run", run_loop)
    _extract(run, "base,chat", "--models-at-once", "2")
    weights = os.path.getsize(os.path.join(models["base"], "model.safetensors"))
    assert len(live) == 2 and live[1] >= live[0] + weights * 0.9, live  # base still there
    assert [(b["state"], b["message"]) for b in waiting] == [
        ("starting", "loaded; waiting for the models loaded beside it")], waiting
    (b0, b1, b_thread), (c0, c1, c_thread) = spans["base"], spans["chat"]
    assert b0 < c1 and c0 < b1 and b_thread != c_thread, spans  # at the same time
    for name in ("base", "chat"):
        assert _objects(run, name) == _objects(alone[name]), name
        assert _checksums(run, name) == _checksums(alone[name])


def test_a_model_that_does_not_fit_beside_runs_after(models, alone, tmp_path, monkeypatch,
                                                     caplog):
    """A device too small for both (its memory measured after the second load says so),
    or one that runs out of memory while the second loads: the second model is let go
    and extracted after the first, with the reason in the log; the bytes are the same."""
    import logging

    from actx.workers import main as worker_main
    from actx.workers.loop import model_groups

    monkeypatch.setattr(model_groups, "fit",
                        lambda jax, workers: model_groups.Fit(False, "9.00 GiB of 8.00 GiB"))
    run = _two_models_run(models, tmp_path / "small")
    real_run, waiting = worker_main._run, []

    def run_loop(worker, sigint):  # while base runs, chat's heartbeat says it waits
        if worker.extraction == "base":
            waiting.extend(_beats(run, "chat"))
        return real_run(worker, sigint)

    monkeypatch.setattr(worker_main, "_run", run_loop)
    with caplog.at_level(logging.INFO, logger="actx.worker"):
        _extract(run, "base,chat", "--models-at-once", "2")
    assert "extraction 'chat' does not fit beside 'base' (9.00 GiB of 8.00 GiB); it runs " \
           "after them" in caplog.text
    assert "at once" not in caplog.text.replace("does not fit", "")
    assert [(b["state"], b["message"]) for b in waiting] == [
        ("starting", "waiting: runs after 'base'")], waiting
    for name in ("base", "chat"):
        assert _objects(run, name) == _objects(alone[name]), name

    monkeypatch.undo()
    real_load = worker_main._load
    calls = []

    def load(opts, sigint, *opened):  # the second load of the first group runs out of memory
        calls.append(opts.extraction)
        if calls == ["base", "chat"]:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                               "1.50GiB")
        return real_load(opts, sigint, *opened)

    monkeypatch.setattr(worker_main, "_load", load)
    run = _two_models_run(models, tmp_path / "oom")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="actx.worker"):
        _extract(run, "base,chat", "--models-at-once", "2")
    assert calls == ["base", "chat", "chat"]
    assert "extraction 'chat' does not fit beside 'base' (RESOURCE_EXHAUSTED" in caplog.text
    for name in ("base", "chat"):
        assert _objects(run, name) == _objects(alone[name]), name


def test_a_stop_signal_ends_both_loops_with_one_line(models, tmp_path):
    """SIGTERM to a worker extracting two models at once: both loops stop at their next
    step, the process exits 143 with one "interrupted" line and no traceback, nothing
    partial is committed (verify passes), and a rerun at once finishes both."""
    import signal
    import time

    from actx.deploy import cli

    run = str(tmp_path / "run")
    n_parts = 384  # enough that neither loop can finish before both are seen working
    token_runs.write_token_run(run, models["base"], n_rows=n_parts * PARTITION_ROWS,
                               hooks=HOOKS, partition_rows=PARTITION_ROWS)
    for name, model in models.items():
        _add(run, name, model)
    proc = worker_procs.start_worker(["--run", run, "--batch-size", "8", "--extraction",
                                      "base,chat", "--models-at-once", "2",
                                      "--heartbeat-s", "0.2"], devices=8)
    views = {name: extraction_store.view(store.open_store(run), name) for name in models}
    deadline = time.monotonic() + 180
    working: set[str] = set()  # the loops seen extracting, each at some poll
    while working != set(views):
        working |= {name for name, v in views.items()
                    if any(f"-{proc.pid}-" in beat.get("attempt", "")
                           and beat.get("state") == "working" and beat.get("tokens_done", 0) > 0
                           for beat in (v.read_json(k) or {} for k in v.list("workers/")))}
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    assert "Traceback" not in out, out
    lines = [line for line in out.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and lines[0].startswith(
        "actx extract: interrupted by SIGTERM"), lines
    done = {name: len(_checksums(run, name)) for name in models}
    assert all(0 < n < n_parts for n in done.values()), done  # both stopped mid-way
    assert cli.main(["verify", run, "--committed-only"], out=io.StringIO()) == 0
    _extract(run, "base,chat", "--models-at-once", "2")
    assert all(len(_checksums(run, name)) == n_parts for name in models)
    assert cli.main(["verify", run], out=io.StringIO()) == 0


def test_working_bytes_counts_the_outputs_in_flight_and_the_cache(both):
    """The working set that decides whether two loops fit: outputs of the steps in flight
    (and the one being handled) per device, plus the KV cache of a context-carrying run,
    computed here from the run's own spec."""
    import jax

    from actx.schemas import worker_options
    from actx.workers.loop import model_groups, runner

    worker = runner.Worker(worker_options.WorkerOptions(run=both, batch_size=8, extraction="chat",
                                                steps_in_flight=3))
    spec = runspec.read_run_spec(extraction_store.view(store.open_store(both), "chat"))
    seq_len, itemsize = spec.packing.seq_len, np.dtype(spec.capture.dtype).itemsize
    slots = 8 // jax.local_device_count()  # the batch split over the 8 CPU devices
    # The tiny Qwen2 (tests/hf_models.py): 3 layers hooked, width 64, 2 kv heads of 16.
    outputs = slots * seq_len * 3 * 64 * itemsize * (3 + 1)
    assert spec.packing.carries_context  # segmented, continue: a cache of whole rows
    capacity = -(-(spec.packing.max_context - 1) // seq_len) * seq_len
    cache = 2 * 3 * slots * capacity * 2 * 16 * 4  # keys and values, float32 model
    assert model_groups.working_bytes(worker) == outputs + cache


def test_model_added_later_and_killed_extraction_rerun(models, alone, tmp_path):
    """A finished single-model run gets a second model later, without preparing again; the
    new extraction's worker is killed after its first commit and rerun: the first model's
    activations and markers are untouched, the new one equals its model alone."""
    import shutil

    run = str(tmp_path / "run")
    shutil.copytree(alone["base"], run)  # the finished run: the default extraction
    before = {**_objects(run), **{f"m{p}": json.dumps(c) for p, c in _checksums(run).items()}}
    markers_before = sorted(os.listdir(os.path.join(run, "commits")))
    _add(run, "chat", models["chat"])
    code, out = worker_procs.run_worker(
        ["--run", run, "--batch-size", "8", "--extraction", "chat"], devices=8,
        ACTX_CRASH_AT="before_commit:2")
    assert code != 0, out
    assert len(_checksums(run, "chat")) == 1  # one partition committed, one not
    from actx.reader import aligned  # reads only what both extractions committed

    with aligned.aligned_stream(run, ["", "chat"], HOOK, 16, buffer_tokens=64) as stream:
        assert stream.partitions == tuple(_checksums(run, "chat"))
        rows = np.concatenate([b.rows for b in stream])
    part = stream.runs["chat"].partitions[stream.partitions[0]]
    assert len(rows) and part.row_start <= rows.min() and rows.max() < part.row_stop
    from actx.deploy import cli

    out = io.StringIO()  # `actx rerun` finishes whichever extraction is behind
    assert cli.main(["rerun", run, "--batch-size", "8", "--devices-per-host", "8"],
                    out=out) == 0, out.getvalue()
    assert "rerun: chat: 1 partition(s) on local" in out.getvalue()
    # The reading hint names every extraction of the run (not only the one rerun: alone,
    # aligned batches refuse it), and runs as printed.
    import re

    said = re.search(r"read them together: (reader\.aligned\.aligned_stream\(.*?\))  ",
                     out.getvalue())
    assert said and "['', 'chat']" in said.group(1), out.getvalue()
    from actx import reader

    with eval(said.group(1).replace("HOOK", repr(HOOK)).replace("BATCH_SIZE", "16"),
              {"reader": reader}) as stream:
        assert next(iter(stream)).rows.size
    assert {**_objects(run), **{f"m{p}": json.dumps(c) for p, c in _checksums(run).items()}} \
        == before
    assert sorted(os.listdir(os.path.join(run, "commits"))) == markers_before
    assert _objects(run, "chat") == _objects(alone["chat"])
    assert _checksums(run, "chat") == _checksums(alone["chat"])
    assert extraction_store.names(store.open_store(run)) == ["", "chat"]


def test_other_token_settings_are_refused(both, models):
    s = store.open_store(both)
    root = runspec.read_run_spec(s)
    other = extraction.spec_for(root, runspec.ModelSpec(path=models["chat"]), root.capture)
    import dataclasses

    other = dataclasses.replace(other, packing=dataclasses.replace(root.packing, seq_len=8))
    with pytest.raises(extraction.ExtractionMismatch, match="only model.. and capture"):
        extraction.add(s, root, "other", other)
    with pytest.raises(ValueError, match="extraction name 'Bad/name'"):
        extraction.add(s, root, "Bad/name", root)


HOOK = "layers.1.resid_post"


def _valid_tokens(run) -> set[tuple[int, int]]:
    seg = run.token_rows("segment_ids", 0, run.total_rows)
    return {(int(r), int(c)) for r, c in zip(*np.nonzero(seg > 0))}


def test_aligned_batches_pair_the_right_tokens(both):
    from actx.reader import aligned, open_run

    alone = {name: open_run(both, extraction=name) for name in ("base", "chat")}
    options = dict(seed=3, buffer_tokens=64, drop_last=False)
    with aligned.aligned_stream(both, ["base", "chat"], HOOK, 16, **options) as stream:
        batches = list(stream)
    seen = [(int(r), int(c)) for b in batches for r, c in zip(b.rows, b.cols)]
    assert sorted(seen) == sorted(_valid_tokens(alone["base"]))  # every token once
    for b in batches:
        assert b.acts.shape == (len(b), 2, 64) and b.extractions == ("base", "chat")
        for k, name in enumerate(b.extractions):  # each model's own activation of the token
            np.testing.assert_array_equal(
                b.acts[:, k], alone[name].gather([HOOK], b.rows, b.cols)[HOOK])
    # The order is the one each extraction's own stream has.
    with alone["chat"].stream(HOOK, 16, **options) as own:
        for b, mine in zip(batches, own):
            np.testing.assert_array_equal(b.rows, mine.rows)
            np.testing.assert_array_equal(b.acts[:, 1], mine.acts[HOOK])
    # Resumable: after batch 1, the rest.
    with aligned.aligned_stream(both, ["base", "chat"], HOOK, 16, **options) as stream:
        state = stream.state(batches[1])
    with aligned.aligned_stream(both, ["base", "chat"], HOOK, 16, resume=state,
                                **options) as stream:
        rest = list(stream)
    assert [b.step for b in rest] == [b.step for b in batches[2:]]
    np.testing.assert_array_equal(rest[0].acts, batches[2].acts)
    # Split across processes: disjoint shares of the same tokens.
    shares = []
    for i in range(2):
        with aligned.aligned_stream(both, ["base", "chat"], HOOK, 8, process_index=i,
                                    process_count=2, **options) as stream:
            shares.append({(int(r), int(c)) for b in stream for r, c in zip(b.rows, b.cols)})
    assert not shares[0] & shares[1] and shares[0] | shares[1] == set(seen)


def test_the_pytorch_dataset_reads_the_extraction_it_names(both):
    """reader.torch_data over a named extraction, by name or from an opened run: each
    batch is that model's activations of the tokens it names."""
    from actx.reader import open_run
    from actx.reader.torch_data import ActivationDataset

    chat = open_run(both, extraction="chat")
    for data in (ActivationDataset(both, HOOK, 16, rank=0, world_size=1, extraction="chat",
                                   with_tokens=True, dtype=torch.float32),
                 ActivationDataset(chat, HOOK, 16, rank=0, world_size=1, with_tokens=True,
                                   dtype=torch.float32)):
        assert data.state_dict(0)["settings"]["extraction"] == "chat"
        batches = list(data)
        assert batches
        for acts, tokens in batches:
            want = chat.gather([HOOK], tokens["rows"].numpy(), tokens["cols"].numpy())[HOOK]
            np.testing.assert_array_equal(acts.numpy(), want.astype(np.float32))
    base = ActivationDataset(both, HOOK, 16, rank=0, world_size=1, extraction="base",
                             with_tokens=True, dtype=torch.float32)
    acts, tokens = next(iter(base))
    assert not np.array_equal(  # the other model's activations of the same tokens
        acts.numpy(), chat.gather([HOOK], tokens["rows"].numpy(),
                                  tokens["cols"].numpy())[HOOK].astype(np.float32))


def test_aligned_filters_hook_per_model_and_normalisation(both):
    """whole_document and token masks as in one extraction's stream, a hook per model, and
    normalisation by each model's own statistics."""
    from actx.reader import aligned

    runs = aligned.open_runs(both, ["base", "chat"])
    for run in runs.values():
        run.compute_stats(["layers.0.resid_post", HOOK])
    stats = {name: run.stats(HOOK) for name, run in runs.items()}  # stored per extraction
    assert stats["base"].mean_norm != stats["chat"].mean_norm
    options = dict(seed=1, buffer_tokens=64, whole_document=True, exclude=["bos"],
                   normalize="unit_mean_norm")
    hooks = {"base": "layers.0.resid_post", "chat": HOOK}
    with aligned.AlignedStream(runs, hooks, 16, **options) as stream:
        batches = list(stream)
    for name, run in runs.items():
        with run.stream(hooks[name], 16, **options) as own:
            mine = list(own)
        assert len(mine) == len(batches)
        for b, m in zip(batches, mine):
            np.testing.assert_array_equal(b.rows, m.rows)
            np.testing.assert_array_equal(b.acts[:, b.extractions.index(name)],
                                          m.acts[hooks[name]])
    with pytest.raises(ValueError, match="outlier"):
        aligned.AlignedStream(runs, HOOK, 16, exclude=["outlier"])


def test_status_follow_and_tpu_plan_per_extraction(both, capsys):
    from actx.deploy import cli, config
    from actx.deploy.targets.tpu_vm import follow as tpu_follow
    from actx.deploy.targets.tpu_vm import plan as tpu_vm

    out = io.StringIO()
    assert cli.main(["status", both, "--check"], out=out) == 0
    text = out.getvalue()
    assert "2 extractions over one token store:" in text
    assert "== extraction base ==" in text and "== extraction chat ==" in text
    out = io.StringIO()
    assert cli.main(["status", both, "--extraction", "chat", "--json"], out=out) == 0
    obj = json.loads(out.getvalue())
    assert obj["complete"] and obj["extractions"]["chat"]["counts"]["committed"] == 2
    # Where the extraction's activations are: under its own prefix (it named the root's).
    where = obj["extractions"]["chat"]["identity"]["activations"]
    assert where == os.path.join(both, "extractions", "chat", "activations")
    assert os.path.isdir(where)
    assert cli.main(["status", both, "--extraction", "sft"], out=io.StringIO()) == 2
    assert "no extraction 'sft' (named extractions: base, chat)" in capsys.readouterr().err
    assert cli.main(["verify", both, "--extraction", "chat"], out=io.StringIO()) == 0
    assert tpu_follow.follow(both, "tpu1-w", 0.0, extraction="base,chat",
                             out=io.StringIO()) == 0
    tpu = config.TpuConfig(name="tpu1", zone="z", project="p", accelerator_type="v4-32")
    plan = tpu_vm.plan("gs://b/runs/r1", config.TargetConfig(batch_size=16, tpu=tpu), None,
                       "j", install=False, extraction="base,chat")
    assert "--extraction base,chat --host-name" in plan[-1].argv[-1]
    assert "--extraction" not in tpu_vm.plan("gs://b/runs/r1", config.TargetConfig(
        batch_size=16, tpu=tpu), "0123", "j", install=False)[-1].argv[-1]


def test_the_page_lists_every_extraction_as_status_counts_it(both, tmp_path):
    """`actx status --html` of a run with two extractions, one of them behind (a marker
    removed: status trusts markers), in Chromium: a line per extraction with the counts
    `status --json` gives it, the one shown in full marked, and `--extraction` picks it."""
    import shutil

    from actx.deploy import cli
    from tests import browser

    browser.require_chromium()
    run = str(tmp_path / "run")
    shutil.copytree(both, run)
    chat = extraction_store.view(store.open_store(run), "chat")
    chat.delete(layout.commit_key(1))
    out = io.StringIO()
    assert cli.main(["status", run, "--json"], out=out) == 0
    want = json.loads(out.getvalue())["extractions"]
    assert want["chat"]["counts"]["committed"] == 1 and want["base"]["counts"]["committed"] == 2
    pages = []
    for args in ([], ["--extraction", "chat,base"]):
        pages.append(str(tmp_path / f"page{len(pages)}.html"))
        assert cli.main(["status", run, "--html", pages[-1], *args], out=io.StringIO()) == 0
    for dom, shown in zip(browser.dump_doms(pages), ("base", "chat")):
        page = browser.Elements(dom)
        for name, st in want.items():
            cells = page.text(f"data-extraction={name}").replace("(this page) ", "").split()
            c = st["counts"]
            assert cells == [name, str(c["committed"]), "/", str(len(st["partitions"])),
                             str(c["in_progress"]), str(c["stale"]), str(c["pending"]),
                             st["phase"]], (name, cells)
            assert ("(this page)" in page.text(f"data-extraction={name}")) == (name == shown)
        # The page's own figures are the shown extraction's.
        assert page.text("n-committed") == str(want[shown]["counts"]["committed"])


def test_a_model_of_another_vocabulary_is_refused_by_the_worker(both, tmp_path):
    """The worker's tokenizer check applies per extraction: a model whose embedding is
    smaller than the token store's vocabulary (512 ids) is refused for it."""
    from actx.schemas import worker_options
    from actx.workers.loop import admission, runner

    small = hf_models.make_tiny_checkpoint(tmp_path / "small", "qwen2", vocab_size=256)
    run = worker_procs.copy_token_store(both, str(tmp_path / "run"))
    _add(run, "small", str(small))
    with pytest.raises(admission.RunMismatch,
                       match=r"larger than the model.s embedding \(256 rows"):
        runner.Worker(worker_options.WorkerOptions(run=run, batch_size=8, extraction="small"))
    assert not os.path.exists(os.path.join(run, "extractions", "small", "activations"))


def test_aligned_batches_of_two_widths_are_a_mapping(both, tmp_path):
    """A model of another width over the same tokens: each batch maps extraction -> its
    [n, d] activations, still the same tokens in each."""
    import shutil

    from actx.reader import aligned, open_run

    narrow = hf_models.make_tiny_checkpoint(tmp_path / "narrow", "qwen2", hidden_size=32,
                                            intermediate_size=64)
    run = str(tmp_path / "run")
    shutil.copytree(both, run)
    _add(run, "narrow", str(narrow))
    _extract(run, "narrow")
    with aligned.aligned_stream(run, ["base", "narrow"], HOOK, 16, seed=5,
                                buffer_tokens=64) as stream:
        batches = list(stream)
    assert batches and all(isinstance(b.acts, dict) for b in batches)
    for name, width in (("base", 64), ("narrow", 32)):
        alone = open_run(run, extraction=name)
        for b in batches:
            assert b.acts[name].shape == (len(b), width)
            np.testing.assert_array_equal(b.acts[name],
                                          alone.gather([HOOK], b.rows, b.cols)[HOOK])


def test_aligned_batches_follow_a_live_run(both, tmp_path):
    """follow=True: a partition joins once committed in every extraction; the batches
    pair the same tokens, every token once, as on the finished run."""
    import shutil
    import threading
    import time

    from actx.reader import aligned, open_run

    run = str(tmp_path / "run")
    shutil.copytree(both, run)
    marker = {name: os.path.join(run, layout.extraction_prefix(name) + layout.commit_key(1))
              for name in ("base", "chat")}
    saved = {}
    for name, path in marker.items():  # partition 1 not yet committed in either
        with open(path, "rb") as f:
            saved[name] = f.read()
        os.remove(path)

    def commit_later():
        for name in ("chat", "base"):  # chat first: not readable until base commits too
            time.sleep(0.3)
            store.open_store(run).create(layout.extraction_prefix(name)
                                         + layout.commit_key(1), saved[name])

    writer = threading.Thread(target=commit_later, daemon=True)
    writer.start()
    options = dict(seed=3, buffer_tokens=64, follow=True, window_partitions=1, poll_s=0.05,
                   wait_timeout_s=60)
    with aligned.aligned_stream(run, ["base", "chat"], HOOK, 16, **options) as stream:
        batches = list(stream)
        order = {n: s.commit_order for n, s in stream.streams.items()}
    writer.join()
    assert order == {"base": (0, 1), "chat": (0, 1)}
    alone = {name: open_run(run, extraction=name) for name in ("base", "chat")}
    seen = [(int(r), int(c)) for b in batches for r, c in zip(b.rows, b.cols)]
    assert sorted(seen) == sorted(_valid_tokens(alone["base"]))  # every token once
    for b in batches:
        for k, name in enumerate(b.extractions):
            np.testing.assert_array_equal(
                b.acts[:, k], alone[name].gather([HOOK], b.rows, b.cols)[HOOK])
    # Resumed after the first batch: the same rest, replayed in the recorded order.
    with aligned.aligned_stream(run, ["base", "chat"], HOOK, 16, **options) as stream:
        state = stream.state(batches[0])
    with aligned.aligned_stream(run, ["base", "chat"], HOOK, 16, resume=state,
                                **options) as stream:
        rest = list(stream)
    assert [b.step for b in rest] == [b.step for b in batches[1:]]
    for a, b in zip(rest, batches[1:]):
        np.testing.assert_array_equal(a.acts, b.acts)


def test_a_damaged_extraction_spec_is_written_again_by_its_config(both, models, tmp_path):
    """An extraction's run.json cut short (not JSON): commands say the run's config writes
    it again; adding the extraction with the spec its markers record (what `actx submit`
    of that config does) writes it back byte for byte and keeps its commits; another
    spec is refused, nothing touched."""
    import shutil

    from actx.schemas import run_dir

    run = str(tmp_path / "run")
    shutil.copytree(both, run)
    key = layout.extraction_key("chat", runspec.RUN_SPEC_KEY)
    path = os.path.join(run, *key.split("/"))
    whole = open(path, "rb").read()
    open(path, "wb").write(whole[:len(whole) // 2])
    with pytest.raises(extraction.ExtractionMismatch,
                       match=r"not valid JSON .*`actx submit` with the run's config"):
        extraction.scoped_all(run_dir.open_run(run), None)
    s = store.open_store(run)
    root = runspec.read_run_spec(s)
    with pytest.raises(run_dir.CommittedRunError, match="run.json is damaged"):
        extraction.add(s, root, "chat", extraction.spec_for(
            root, runspec.ModelSpec(path=models["base"], dtype="float32"), root.capture))
    assert open(path, "rb").read() == whole[:len(whole) // 2]
    before = _checksums(run, "chat")
    _add(run, "chat", models["chat"])
    assert open(path, "rb").read() == whole
    assert _checksums(run, "chat") == before and before


def test_a_damaged_spec_of_an_extraction_that_committed_nothing_is_replaced(both, models,
                                                                           tmp_path):
    """An extraction that committed nothing, whose run.json is cut short, with what an
    earlier attempt under another model left in its activations/: adding it again (what
    `actx submit` of the run's config does) writes its spec, clears that attempt's record
    and arrays (a worker would refuse them for the new spec) and says so under changes/;
    its worker then extracts it, equal to that model's extraction."""
    import shutil

    run = str(tmp_path / "run")
    shutil.copytree(both, run)
    _add(run, "late", models["chat"])
    late = os.path.join(run, *layout.extraction_prefix("late").strip("/").split("/"))
    shutil.copytree(os.path.join(run, *layout.extraction_prefix("chat").strip("/").split("/"),
                                 layout.ACTIVATIONS_GROUP),
                    os.path.join(late, layout.ACTIVATIONS_GROUP))
    spec_path = os.path.join(late, runspec.RUN_SPEC_KEY)
    whole = open(spec_path, "rb").read()
    open(spec_path, "wb").write(whole[:len(whole) // 2])
    changes_dir = os.path.join(run, "changes")
    changes = set(os.listdir(changes_dir)) if os.path.isdir(changes_dir) else set()
    _add(run, "late", models["base"])
    assert not [f for _, _, files in os.walk(os.path.join(late, layout.ACTIVATIONS_GROUP))
                for f in files]
    [new] = set(os.listdir(changes_dir)) - changes
    record = json.load(open(os.path.join(changes_dir, new)))
    assert record["kind"] == "extraction-spec" and record["extraction"] == "late"
    assert record["to_fingerprint"] == runspec.read_run_spec(
        extraction_store.view(store.open_store(run), "late")).fingerprint
    _extract(run, "late")
    assert _checksums(run, "late") == _checksums(both, "base") != {}
