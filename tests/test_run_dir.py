"""A run is opened one way (schemas.run_dir) and user errors share one base class that the
CLI maps to exit code 2; activations/actx.json has one typed definition."""

from __future__ import annotations

import io
import json

import pytest

from actx.schemas import activations_info, errors, layout, run_dir, store


def test_every_input_error_is_a_user_error():
    from actx import reader
    from actx.deploy import targets
    from actx.deploy.targets.tpu_vm import plan as tpu_vm
    from actx.pipeline import fileio, prepare_refusals, tokenize
    from actx.schemas import config, store_errors
    from actx.workers.loop import admission

    for cls in (config.ConfigError, fileio.InputError, tokenize.TokenizerError,
                prepare_refusals.PrepareError, admission.RunMismatch, tpu_vm.TargetError,
                targets.UsageError, store_errors.StoreError, reader.ReaderError,
                reader.NotARunError, reader.UnknownHookError, errors.NotARunError):
        assert issubclass(cls, errors.UserError), cls
    # The builtin bases callers have always caught stay.
    assert issubclass(config.ConfigError, ValueError)
    assert issubclass(reader.NotARunError, FileNotFoundError)
    assert issubclass(reader.NotARunError, errors.NotARunError)


def test_not_a_run_is_said_the_same_way_by_every_stage(tmp_path, capsys):
    from actx import reader
    from actx.deploy import cli
    from actx.schemas import worker_options
    from actx.workers.loop import runner

    empty = tmp_path / "empty"
    empty.mkdir()
    messages = []
    with pytest.raises(errors.NotARunError) as e:
        run_dir.open_run(str(empty))
    messages.append(str(e.value))
    with pytest.raises(reader.NotARunError) as e:
        reader.open_run(str(empty))
    messages.append(str(e.value))
    with pytest.raises(FileNotFoundError) as e:
        runner.Worker(worker_options.WorkerOptions(run=str(empty)))
    messages.append(str(e.value))
    for command in ("status", "verify", "rerun"):
        assert cli.main([command, str(empty)], out=io.StringIO()) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"actx {command}: error: ") and err.count("\n") == 1
        messages.append(err.split("error: ", 1)[1].strip())
    assert len(set(messages)) == 1, messages
    assert "not an actx run (no run.json)" in messages[0]


def test_a_user_error_raised_anywhere_exits_2_in_one_line(tmp_path, capsys):
    from actx.deploy import cli

    assert cli.main(["status", str(tmp_path / "run"), "--serve", "1", "--refresh", "0"],
                    out=io.StringIO()) == 2  # no run: said before the flag
    empty_run = tmp_path / "r"
    empty_run.mkdir()
    (empty_run / "run.json").write_text("{not json")
    assert cli.main(["status", str(empty_run)], out=io.StringIO()) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("actx status: error: ") for line in err)


def test_activations_info_writes_the_json_of_before(tmp_path):
    s = store.open_store(str(tmp_path))
    numerics = activations_info.Numerics(platform="cpu", device_kind="cpu", jax="0.4.0",
                                         rows_per_device=2, model_parallel=1,
                                         attention="xla")
    info = activations_info.ActivationsInfo(fingerprint="abc", dtype="bfloat16",
                                            hooks={"layers.0.resid_post": 64, "embed": 64},
                                            model_digest="d1", numerics=numerics)
    assert activations_info.create_info(s, info)
    assert not activations_info.create_info(s, info)  # create-only
    assert json.loads(s.read(layout.ACTIVATIONS_INFO_KEY)) == {
        "fingerprint": "abc", "dtype": "bfloat16",
        "hooks": {"layers.0.resid_post": 64, "embed": 64}, "model_digest": "d1",
        "numerics": {"platform": "cpu", "device_kind": "cpu", "jax": "0.4.0",
                     "rows_per_device": 2, "model_parallel": 1, "attention": "xla"}}
    assert activations_info.read_info(s) == info
    assert info.bytes_per_row(16) == 16 * 2 * 128


def test_a_record_from_before_the_attention_field_reads_and_still_matches(tmp_path):
    """Runs recorded before the attention implementation was part of the numerics keep
    working: their record reads, and a worker whose other numerics match may continue."""
    s = store.open_store(str(tmp_path))
    old = {"platform": "cpu", "device_kind": "cpu", "jax": "0.4.0", "rows_per_device": 2,
           "model_parallel": 1}
    s.write_json(layout.ACTIVATIONS_INFO_KEY, {"fingerprint": "abc", "dtype": "bfloat16",
                                               "hooks": {"embed": 64}, "numerics": old})
    recorded = activations_info.read_info(s).numerics
    assert recorded.attention is None
    mine = activations_info.Numerics(**old, attention="xla")
    assert recorded.same_bytes_as(mine) and mine.same_bytes_as(recorded)
    assert not recorded.same_bytes_as(activations_info.Numerics(**{**old, "jax": "0.5"},
                                                                attention="xla"))
    assert not mine.same_bytes_as(activations_info.Numerics(**old, attention="pallas_gpu"))


def test_damaged_activations_info_names_key_and_field(tmp_path):
    from actx.schemas import config

    s = store.open_store(str(tmp_path))
    s.write_json(layout.ACTIVATIONS_INFO_KEY, {"fingerprint": "abc", "dtype": "bfloat16",
                                               "hooks": {"embed": "wide"}})
    with pytest.raises(config.ConfigError, match=r"activations/actx.json: hooks.embed"):
        activations_info.read_info(s)


def test_layout_keys_of_claims_logs_and_shards():
    assert layout.claim_key("j1", 42) == "claims/j1/p-00042.json"
    assert layout.log_key("j1", "host-3") == "logs/j1/host-3.log"
    key = layout.activation_shard_key("layers.2.resid_post", 7)
    assert key == "activations/layers.2.resid_post/c/7/0/0"
    assert layout.shard_index_of("layers.2.resid_post", key) == 7
    assert layout.shard_index_of("layers.2.resid_post",
                                 "activations/layers.2.resid_post/c/x") is None
