"""Small things a user hits on the command line: the example in `--set`'s error works,
`actx down` on a config that is not tpu-vm says so, relative paths of a config are the
config's (and run.json records them absolute), and no command prints Beam's apitools
notice when google-apitools is not installed (`actx-lm[pipeline]` does not install it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import yaml

from actx.deploy import config as config_lib
from actx.schemas import store

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs `python -m actx.deploy.cli ARGS` as if google-apitools were not installed.
WITHOUT_APITOOLS = """
import importlib.abc, runpy, sys
class _NoApitools(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "apitools" or name.startswith("apitools."):
            raise ImportError("No module named " + repr(name))
sys.meta_path.insert(0, _NoApitools())
sys.argv = ["actx", *sys.argv[1:]]
runpy.run_module("actx.deploy.cli", run_name="__main__")
"""


def _actx(*args, cwd=REPO, without_apitools=False):
    env = {**os.environ, "PYTHONPATH": REPO}
    cmd = ([sys.executable, "-c", WITHOUT_APITOOLS, *args] if without_apitools
           else [sys.executable, "-m", "actx.deploy.cli", *args])
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _layout(tmp_path, qwen_tokenizer_dir) -> tuple[str, str]:
    """configs/c.yaml naming its data as `../data/t.jsonl` (relative to the config)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "t.jsonl").write_text("".join(
        json.dumps({"text": f"document {i} " * 5}) + "\n" for i in range(6)))
    (tmp_path / "configs").mkdir()
    spec = {"name": "rel", "model": {"path": ""}, "tokenizer": {"path": qwen_tokenizer_dir},
            "sources": [{"kind": "text", "paths": ["../data/t.jsonl"]}],
            "packing": {"seq_len": 16}, "layout": {"rows_per_shard": 2, "partition_rows": 4}}
    config = tmp_path / "configs" / "c.yaml"
    config.write_text(yaml.safe_dump({"run": str(tmp_path / "run"), "spec": spec,
                                      "target": {"kind": "local", "batch_size": 2}}))
    spec_file = tmp_path / "configs" / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    return str(config), str(spec_file)


def test_the_example_of_sets_error_is_valid(tmp_path, qwen_tokenizer_dir):
    config, _ = _layout(tmp_path, qwen_tokenizer_dir)
    proc = _actx("submit", config, "--set", "seq_len")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    example = re.search(r"e\.g\. (\S+)", proc.stderr).group(1)
    loaded = config_lib.load_submit_config(config, [example])
    assert example == "spec.packing.seq_len=512" and loaded.spec.packing.seq_len == 512


def test_down_on_a_config_that_is_not_tpu_vm_says_so(tmp_path, qwen_tokenizer_dir):
    config, _ = _layout(tmp_path, qwen_tokenizer_dir)
    proc = _actx("down", "--config", config)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert (f"{config}: target.kind is 'local'; actx down deletes the TPU slice that "
            f"`actx submit` created for a tpu-vm target, and this config has none") \
        in proc.stderr


def test_relative_paths_are_the_configs_and_recorded_absolute(tmp_path, qwen_tokenizer_dir,
                                                              monkeypatch):
    config, spec_file = _layout(tmp_path, qwen_tokenizer_dir)
    data = str(tmp_path / "data" / "t.jsonl")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert config_lib.load_submit_config(config).spec.sources[0].paths == (data,)
    # `actx prepare --spec` from another directory: the spec file's paths, stored absolute.
    proc = _actx("prepare", "--spec", spec_file, "--out", str(tmp_path / "run"),
                 "--runner=FnApiRunner", cwd=str(elsewhere))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_json = store.open_store(str(tmp_path / "run")).read_json("run.json")
    assert run_json["sources"][0]["paths"] == [data]
    # Flags are the shell's: relative to the working directory.
    proc = _actx("prepare", "--tokenizer", qwen_tokenizer_dir, "--text", "../data/t.jsonl",
                 "--seq-len", "16", "--out", str(tmp_path / "run2"), "--runner=FnApiRunner",
                 cwd=str(elsewhere))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert store.open_store(str(tmp_path / "run2")).read_json("run.json")["sources"][0][
        "paths"] == [data]


def test_no_command_prints_the_apitools_notice(tmp_path, qwen_tokenizer_dir):
    config, spec_file = _layout(tmp_path, qwen_tokenizer_dir)
    runs = {
        "prepare": _actx("prepare", "--spec", spec_file, "--out", str(tmp_path / "run"),
                         "--runner=FnApiRunner", without_apitools=True),
        "submit (refused in pre-flight)": _actx("submit", config, "--set",
                                                "spec.capture.hooks=garbage!!",
                                                without_apitools=True),
        "status": _actx("status", str(tmp_path / "run"), without_apitools=True),
    }
    assert runs["prepare"].returncode == 0, runs["prepare"].stderr
    assert runs["submit (refused in pre-flight)"].returncode == 2
    for name, proc in runs.items():
        assert "apitools" not in proc.stdout + proc.stderr, (name, proc.stderr)
    # The prepare's own log lines keep their format (the notice used to configure logging).
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ prepare: ", runs["prepare"].stderr,
                     re.M), runs["prepare"].stderr
