"""Bad inputs through the real `actx` command line (subprocesses, as a user types them):
each is refused with exit 2 before any work, in lines without a traceback, writing nothing;
none ends in a false OK. The module's last test prints the figures:
`bad inputs tried: N; clear exit 2 before work: N; tracebacks: 0; false OK: 0`.

Each case names what it must say; the models are real checkpoints written by transformers'
`save_pretrained`, then damaged the way downloads and mix-ups damage them.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
import yaml

from tests import hf_models

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN_ROWS = 151936
FIGURES = {"tried": 0, "clear": 0, "tracebacks": 0, "false_ok": 0}


@pytest.fixture(scope="module")
def good_model(tmp_path_factory) -> str:
    return hf_models.make_tiny_checkpoint(tmp_path_factory.mktemp("good") / "m", "qwen2",
                                          vocab_size=QWEN_ROWS, num_hidden_layers=2)


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory) -> str:
    """A byte-level BPE of 282 ids: another model's tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([f"text {i} of a small corpus " * 3 for i in range(50)],
                            trainers.BpeTrainer(vocab_size=282, special_tokens=["<s>", "</s>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel
                                                .alphabet()))
    out = tmp_path_factory.mktemp("small") / "tok"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    return str(out)


def _copy(model: str, out) -> str:
    shutil.copytree(model, out)
    return str(out)


def _truncated(model, tmp_path):
    m = _copy(model, tmp_path / "truncated")
    path = os.path.join(m, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 1000)
    return m


def _garbage_header(model, tmp_path):
    m = _copy(model, tmp_path / "garbage")
    path = os.path.join(m, "model.safetensors")
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8)
        f.write(b"{not json" + b" " * (n - 9))
    return m


def _more_layers_than_weights(model, tmp_path):
    m = _copy(model, tmp_path / "bigger")
    cfg = json.load(open(os.path.join(m, "config.json")))
    cfg.update(num_hidden_layers=3, layer_types=cfg["layer_types"] + cfg["layer_types"][:1])
    json.dump(cfg, open(os.path.join(m, "config.json"), "w"))
    return m


def _int_weights(model, tmp_path):
    from safetensors.numpy import load_file, save_file

    m = _copy(model, tmp_path / "ints")
    path = os.path.join(m, "model.safetensors")
    tensors = load_file(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype("int32")
    save_file(tensors, path, metadata={"format": "pt"})
    return m


def _actx(*args, env=None, timeout=120):
    env = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _texts(tmp_path) -> str:
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": f"document {i} " * 6}) + "\n"
                            for i in range(8)))
    return str(path)


def _config(tmp_path, model, tokenizer, hooks="layers.0.resid_post", target=None,
            run=None) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "run": run or str(tmp_path / "run"),
        "spec": {"name": "bad", "model": {"path": model}, "tokenizer": {"path": tokenizer},
                 "sources": [{"kind": "text", "paths": [_texts(tmp_path)]}],
                 "packing": {"seq_len": 16},
                 "layout": {"rows_per_shard": 2, "partition_rows": 4},
                 "capture": {"hooks": hooks}},
        "target": target or {"kind": "local", "hosts": 1, "batch_size": 2}}))
    return str(path)


NO_CREDENTIALS = {"STORAGE_EMULATOR_HOST": None, "GOOGLE_APPLICATION_CREDENTIALS": None,
                  "NO_GCE_CHECK": "True"}


def _no_credentials_env(tmp_path) -> dict:
    return {**NO_CREDENTIALS, "HOME": str(tmp_path), "CLOUDSDK_CONFIG": str(tmp_path)}


# name -> (build(tmp_path, model, qwen_tok, small_tok) -> (argv, env), texts it must say)
CASES = {
    "tokenizer of another model (282 ids)": (
        lambda t, m, q, s: (["submit", _config(t, m, s)], None),
        ["far smaller than the model's embedding (151,936 rows", "allow_model_mismatch"]),
    "prepare with another model's tokenizer": (
        lambda t, m, q, s: (["prepare", "--out", str(t / "run"), "--tokenizer", s, "--model",
                             m, "--text", _texts(t), "--runner=FnApiRunner"], None),
        ["far smaller than the model's embedding"]),
    "a tokenizer other than the checkpoint's own": (
        lambda t, m, q, s: (["submit", _config(t, _with_tokenizer(m, q, t), s)], None),
        ["is not the tokenizer of the model", "vocabulary: 282 vs 151,665 ids"]),
    "batch_size 0": (
        lambda t, m, q, s: (["submit", _config(t, m, q, target={"kind": "local",
                                                                 "batch_size": 0})], None),
        ["batch_size must be at least 1, got 0"]),
    "negative batch size and writer threads at once": (
        lambda t, m, q, s: (["submit", _config(t, m, q, target={
            "kind": "local", "batch_size": -4, "writer_threads": 0})], None),
        ["batch_size must be at least 1, got -4", "writer_threads must be at least 1"]),
    "an empty hook list": (
        lambda t, m, q, s: (["submit", _config(t, m, q, hooks="")], None),
        ["no hooks given"]),
    "garbage hooks in a dry run that cannot reach the model": (
        lambda t, m, q, s: (["submit", _config(
            t, "gs://actx-no-bucket/models/m", q, hooks="garbage!!",
            target={"kind": "tpu-vm", "batch_size": 8,
                    "tpu": {"name": "t", "zone": "z", "project": "p",
                            "accelerator_type": "v4-8"}},
            run="gs://actx-no-bucket/runs/r"), "--dry-run"], _no_credentials_env(t)),
        ["cannot parse hook 'garbage!!'"]),
    "a truncated safetensors file": (
        lambda t, m, q, s: (["submit", _config(t, _truncated(m, t), q)], None),
        ["model.safetensors:", "but its header describes", "download it again"]),
    "a safetensors header that does not parse": (
        lambda t, m, q, s: (["submit", _config(t, _garbage_header(m, t), q)], None),
        ["the safetensors header does not parse"]),
    "a config with more layers than the weights": (
        lambda t, m, q, s: (["submit", _config(t, _more_layers_than_weights(m, t), q)], None),
        ["tensor(s) the model needs are in none of its safetensors files",
         "model.layers.2.input_layernorm.weight"]),
    "integer weights": (
        lambda t, m, q, s: (["submit", _config(t, _int_weights(m, t), q)], None),
        ["tensor model.norm.weight has dtype I32"]),
}


def _with_tokenizer(model, tokenizer, tmp_path) -> str:
    m = _copy(model, tmp_path / "with_tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer, name), m)
    return m


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_refused_before_work(name, tmp_path, good_model, qwen_tokenizer_dir,
                                          small_tokenizer):
    build, expected = CASES[name]
    argv, env = build(tmp_path, good_model, qwen_tokenizer_dir, small_tokenizer)
    proc = _actx(*argv, env=env)
    said = proc.stdout + proc.stderr
    FIGURES["tried"] += 1
    FIGURES["tracebacks"] += "Traceback" in said
    FIGURES["false_ok"] += proc.returncode == 0
    assert proc.returncode == 2 and "Traceback" not in said, said
    for text in expected:
        assert text in said, said
    assert not (tmp_path / "run").exists(), "work started"
    FIGURES["clear"] += 1


def test_figures(request):
    """Runs last in this module: the figures of the cases above, in one line."""
    if FIGURES["tried"] == 0:
        pytest.skip("no bad input ran")
    line = (f"bad inputs tried: {FIGURES['tried']}; clear exit 2 before work: "
            f"{FIGURES['clear']}; tracebacks: {FIGURES['tracebacks']}; false OK: "
            f"{FIGURES['false_ok']}")
    print("\n" + line)

    class _Summary:
        def pytest_terminal_summary(self, terminalreporter):
            terminalreporter.write_sep("-", "bad inputs")
            terminalreporter.write_line(line)

    request.config.pluginmanager.register(_Summary(), "actx-bad-input-figures")
    assert FIGURES["tracebacks"] == 0 and FIGURES["false_ok"] == 0
    assert FIGURES["clear"] == FIGURES["tried"]
