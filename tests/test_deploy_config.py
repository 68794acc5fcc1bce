"""Submit configs: the embedded demo config loads, overrides apply, and bad input is an
error naming the key and the file (exit 2, no traceback)."""

from __future__ import annotations

import io
import pathlib

import pytest
import yaml

from actx.deploy import cli, config
from actx.schemas import config as schemas_config

REPO = pathlib.Path(__file__).resolve().parents[1]
SPEC = {"model": {"path": "m"}, "tokenizer": {"path": "t"},
        "sources": [{"kind": "text", "paths": ["x.jsonl"]}]}


def _toml_value(v) -> str:
    import json

    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v)


def _toml(data: dict) -> str:
    """Enough TOML for these configs: top-level scalars, then one table per dict."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for k, v in data.items():
        if isinstance(v, dict):
            lines.append(f"[{k}]")
            lines += [f"{kk} = {_toml_value(vv)}" for kk, vv in v.items()]
    return "\n".join(lines) + "\n"


def test_demo_config_loads_with_cache_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("ACTX_CACHE", str(tmp_path))
    cfg = config.load_submit_config(None, ["target.hosts=4", "spec.packing.seq_len=256"])
    assert cfg.demo_assets and cfg.run == "runs/demo"
    assert cfg.spec.model.path == f"{tmp_path}/demo/qwen2-tiny-random"
    assert cfg.spec.tokenizer.path == f"{tmp_path}/qwen2-tokenizer"
    assert (cfg.target.kind, cfg.target.hosts, cfg.target.replicas) == ("local", 4, 4)
    assert cfg.spec.packing.seq_len == 256


@pytest.mark.parametrize("fmt", ["yaml", "toml"])
@pytest.mark.parametrize("target,key,fragment", [
    ({"kind": "local", "hostz": 2}, "target.hostz", "unknown key (did you mean 'hosts'?)"),
    ({"hosts": "two"}, "target.hosts", "expected an integer"),
    ({"tpu": {"zonee": "x"}}, "target.tpu.zonee", "unknown key"),
    ({"kind": "k8s"}, "target.kind", "expected one of"),
    ({"hosts": 3, "hosts_per_replica": 2}, "target", "multiple of hosts_per_replica"),
])
def test_bad_config_names_key_and_file(tmp_path, capsys, fmt, target, key, fragment):
    data = {"run": "runs/x", "spec": SPEC, "target": target}
    path = tmp_path / f"c.{fmt}"
    if fmt == "yaml":
        path.write_text(yaml.safe_dump(data))
    else:
        path.write_text(_toml(data))
    code = cli.main(["submit", str(path)], out=io.StringIO())
    err = capsys.readouterr().err
    assert code == 2
    assert f"{path}: {key}" in err and fragment in err, err
    assert "Traceback" not in err


def test_wrong_type_in_spec_and_unknown_top_level_key(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"run": "r", "spec": {**SPEC, "packing": {"seq_len": "long"}}}))
    assert cli.main(["submit", str(path)], out=io.StringIO()) == 2
    assert f"{path}: spec.packing.seq_len: expected an integer" in capsys.readouterr().err
    path.write_text(yaml.safe_dump({"run": "r", "spec": SPEC, "taget": {}}))
    assert cli.main(["submit", str(path)], out=io.StringIO()) == 2
    assert f"{path}: taget: unknown key (did you mean 'target'?)" in capsys.readouterr().err


def test_set_override_is_validated_too(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"run": "r", "spec": SPEC}))
    assert cli.main(["submit", str(path), "--set", "target.batch_size=big"],
                    out=io.StringIO()) == 2
    assert f"{path}: target.batch_size: expected an integer" in capsys.readouterr().err
    assert cli.main(["submit", str(path), "--set", "nonsense"], out=io.StringIO()) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err


def test_missing_or_unparseable_config(tmp_path, capsys):
    assert cli.main(["submit", str(tmp_path / "nope.yaml")], out=io.StringIO()) == 2
    assert "nope.yaml: config file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("run = [unclosed\n")
    assert cli.main(["submit", str(bad)], out=io.StringIO()) == 2
    assert f"{bad}: cannot parse config" in capsys.readouterr().err


@pytest.mark.parametrize("suffix,text", [
    (".yaml", "run: r\nspec:\n  capture:\n    hooks: a\n  capture:\n    hooks: b\n"),
    (".json", '{"run": "r", "spec": {"capture": {"hooks": "a"}, "capture": {"hooks": "b"}}}')])
def test_a_key_given_twice_is_refused_naming_it(tmp_path, capsys, suffix, text):
    """YAML and JSON keep the last of a key given twice in silence: a second `capture:`
    block would drop the first. Refused, naming the key (and, in YAML, both lines)."""
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    assert cli.main(["submit", str(path)], out=io.StringIO()) == 2
    said = capsys.readouterr().err
    assert f"{path}: cannot parse config" in said and "'capture'" in said, said
    if suffix == ".yaml":
        assert "line 3" in said and "line 5" in said and "a second time" in said, said


def test_a_yaml_merge_key_stays_legal(tmp_path):
    """`<<: *anchor` merges a mapping whose keys the mapping may give again (they win)."""
    from actx.schemas import config

    path = tmp_path / "c.yaml"
    path.write_text("base: &b {batch_size: 4, hosts: 2}\ntarget:\n  <<: *b\n  hosts: 3\n")
    assert config.load_file(path)["target"] == {"batch_size": 4, "hosts": 3}


def test_example_configs_load():
    import glob
    import os

    paths = sorted(glob.glob(os.path.join(REPO, "configs", "*.*")))
    paths.append(config.DEMO_CONFIG)
    assert len(paths) >= 3
    for path in paths:
        cfg = config.load_submit_config(path)
        assert isinstance(cfg.spec.fingerprint, str)


def test_rerun_config_target_errors_name_file(tmp_path, capsys):
    from tests import token_runs

    run = str(tmp_path / "run")
    token_runs.write_token_run(run, "unused")
    cfg = tmp_path / "t.yaml"
    cfg.write_text(yaml.safe_dump({"target": {"hosts": 1.5}}))
    assert cli.main(["rerun", run, "--config", str(cfg)], out=io.StringIO()) == 2
    assert f"{cfg}: target.hosts: expected an integer" in capsys.readouterr().err


def test_schemas_config_error_type_is_what_cli_catches():
    with pytest.raises(schemas_config.ConfigError):
        schemas_config.from_dict(config.TargetConfig, {"nope": 1}, "f.yaml: target")


def test_prepare_and_extract_delegate_to_entry_points(tmp_path, capsys):
    # `actx extract` is workers.main.main in this process; a non-run is its exit code 2.
    assert cli.main(["extract", "--run", str(tmp_path)]) == 2
    assert "not an actx run" in capsys.readouterr().err
    # `actx prepare` is pipeline.main.main; a missing tokenizer is its exit code 2.
    src = tmp_path / "a.jsonl"
    src.write_text('{"text": "hi"}\n')
    assert cli.main(["prepare", "--out", str(tmp_path / "r"), "--tokenizer",
                     str(tmp_path / "none"), "--text", str(src)]) == 2
    assert "tokenizer not found" in capsys.readouterr().out
