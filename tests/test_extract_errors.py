"""Workers refuse runs they must not write into, with errors that say what to do."""

from __future__ import annotations

import os
import signal
import time

import pytest

from actx.schemas import layout, stop_signals, store, worker_options
from tests import hf_models, token_runs
from actx.workers import main as worker_main
from actx.workers.loop import admission, runner


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(hf_models.make_tiny_checkpoint(tmp_path_factory.mktemp("m") / "qwen2", "qwen2"))


def test_fingerprint_mismatch_is_refused(model_dir, tmp_path, capsys):
    run = str(tmp_path / "run")
    spec = token_runs.write_token_run(run, model_dir, n_rows=8, partition_rows=8)
    code = worker_main.main(["--run", run, "--expect-fingerprint", "0123456789abcdef"])
    err = capsys.readouterr().err
    assert code == 2
    assert spec.fingerprint in err and "0123456789abcdef" in err and "new run directory" in err


def test_an_in_process_worker_gives_ctrl_c_back(model_dir, tmp_path):
    """`workers.main.main` called in a process of the caller's (a test, a notebook) handles
    SIGINT and SIGTERM only while it runs: afterwards the caller's own handler gets them
    again, not the finished worker's, which would only ask its loop to stop."""
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, model_dir, n_rows=8, partition_rows=8)
    received: list[int] = []
    with stop_signals.handled(lambda signum, frame: received.append(signum)):
        ours = signal.getsignal(signal.SIGINT)
        assert worker_main.main(["--run", run]) == 0
        assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == [ours] * 2
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 10
        while not received and time.monotonic() < deadline:
            time.sleep(0.01)
    assert received == [signal.SIGINT]


def test_a_stop_signal_that_surfaces_as_an_import_error_while_loading_is_a_stop(
        model_dir, tmp_path, monkeypatch, capsys):
    """SIGTERM while the worker loads, raised inside a C extension's initialisation, comes
    out as that module's ImportError (what pybind11 makes of it: seen with tensorstore):
    the worker still exits 143 with the one interrupted line, not a traceback."""
    from actx.workers.flax import worker as flax_worker

    run = str(tmp_path / "run")
    token_runs.write_token_run(run, model_dir, n_rows=8, partition_rows=8)

    def loading_meets_a_signal(opts, opened=None):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except KeyboardInterrupt as e:
            raise ImportError("initialization failed") from e
        raise AssertionError("the worker's handler did not raise")

    monkeypatch.setattr(flax_worker, "worker_for_run", loading_meets_a_signal)
    assert worker_main.main(["--run", run]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "SIGTERM" in err and f"actx rerun {run}" in err and "Traceback" not in err, err


def test_missing_manifest_is_a_clear_error(model_dir, tmp_path):
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, model_dir, n_rows=8, partition_rows=8)
    store.open_store(run).delete(layout.MANIFEST_KEY)
    with pytest.raises(FileNotFoundError, match=r"manifest.json: missing.*actx prepare"):
        runner.Worker(worker_options.WorkerOptions(run=run))


def test_not_a_run_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an actx run"):
        runner.Worker(worker_options.WorkerOptions(run=str(tmp_path / "nothing")))


def test_tokenizer_vocab_larger_than_model_is_refused(model_dir, tmp_path):
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, model_dir, n_rows=8, partition_rows=8, vocab=1000)
    with pytest.raises(admission.RunMismatch, match=r"1000 ids.*512 rows.*do not belong together"):
        runner.Worker(worker_options.WorkerOptions(run=run))


def test_mesh_that_does_not_divide_batch_is_refused(model_dir, tmp_path):
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, model_dir, n_rows=8, partition_rows=8)
    # 8 CPU devices (conftest) and model parallel 1: the data axis is 8.
    with pytest.raises(ValueError, match=r"batch.* 6.*8"):
        runner.Worker(worker_options.WorkerOptions(run=run, batch_size=6))


def test_activations_of_another_spec_are_refused(model_dir, tmp_path):
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, model_dir, n_rows=8, partition_rows=8)
    s = store.open_store(run)
    s.write_json("activations/actx.json", {"fingerprint": "other", "dtype": "float32",
                                            "hooks": {}})
    with pytest.raises(admission.RunMismatch, match="activations were written for"):
        runner.Worker(worker_options.WorkerOptions(run=run, batch_size=8))


def test_other_numerics_are_refused_unless_allowed(model_dir, tmp_path):
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, model_dir, n_rows=8, partition_rows=8)
    first = runner.Worker(worker_options.WorkerOptions(run=run, batch_size=8))
    assert first.numerics_key()["rows_per_device"] == 1
    assert first.run() == 0  # a committed partition: its bytes depend on the numerics
    # 16 rows a step on the same 8 devices: 2 rows per device, other XLA blocking.
    with pytest.raises(admission.RunMismatch, match=r"rows_per_device.*--allow-numerics-change"):
        runner.Worker(worker_options.WorkerOptions(run=run, batch_size=16))
    runner.Worker(worker_options.WorkerOptions(run=run, batch_size=16, allow_numerics_change=True))


def test_other_weights_at_the_same_path_are_refused(tmp_path):
    model = str(hf_models.make_tiny_checkpoint(tmp_path / "m", "qwen2", seed=0))
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, model, n_rows=8, partition_rows=8)
    assert runner.Worker(worker_options.WorkerOptions(run=run, batch_size=8)).run() == 0
    hf_models.make_tiny_checkpoint(tmp_path / "m", "qwen2", seed=1)  # retrained in place
    with pytest.raises(admission.RunMismatch, match=r"weights at .* changed"):
        runner.Worker(worker_options.WorkerOptions(run=run, batch_size=8))


def test_numerics_and_weights_may_change_while_nothing_is_committed(tmp_path):
    """An attempt that committed nothing binds nothing: the next one takes the record over,
    and the change is recorded in the run."""
    import json

    model = str(hf_models.make_tiny_checkpoint(tmp_path / "m", "qwen2", seed=0))
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, model, n_rows=8, partition_rows=8)
    runner.Worker(worker_options.WorkerOptions(run=run, batch_size=8))  # admitted, never ran
    second = runner.Worker(worker_options.WorkerOptions(run=run, batch_size=16))
    hf_models.make_tiny_checkpoint(tmp_path / "m", "qwen2", seed=1)
    third = runner.Worker(worker_options.WorkerOptions(run=run, batch_size=16))
    s = store.open_store(run)
    info = json.loads(s.read(layout.ACTIVATIONS_INFO_KEY))
    assert (info["numerics"]["rows_per_device"] == 2
            and info["model_digest"] == third.loaded.model.digest)
    assert second.loaded.model.digest != third.loaded.model.digest
    changes = sorted((json.loads(s.read(k)) for k in s.list(layout.CHANGES_PREFIX)),
                     key=lambda c: c["at"])
    assert [c["kind"] for c in changes] == ["activations-info", "activations-info"]
    assert changes[0]["before"]["numerics"]["rows_per_device"] == 1
    assert changes[1]["before"]["model_digest"] == second.loaded.model.digest
    assert third.run() == 0
    # Once a partition is committed the record binds again.
    with pytest.raises(admission.RunMismatch, match=r"rows_per_device.*--allow-numerics-change"):
        runner.Worker(worker_options.WorkerOptions(run=run, batch_size=8))
