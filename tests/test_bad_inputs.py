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
    return subprocess.run([sys.executable, "-m", "actx.deploy.cli", *args], cwd=REPO, env=env,
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
    "actx extract with batch size 0": (
        lambda t, m, q, s: (["extract", "--run", str(t / "run"), "--batch-size", "0",
                             "--prefetch-depth", "0"], None),
        ["actx extract: error: batch_size must be at least 1, got 0; prefetch_depth must be "
         "at least 1, got 0"]),
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


def test_a_refused_submit_answers_without_importing_beam_or_jax(tmp_path, good_model,
                                                               qwen_tokenizer_dir):
    """The pre-flight reads the config, the checkpoint's headers and the tokenizer, and
    nothing more: a bad config comes back without Apache Beam (seconds of imports) or
    JAX being imported."""
    probe = ("import sys; from actx.deploy import cli; code = cli.main(sys.argv[1:]); "
             "print('imported:', [m for m in ('apache_beam', 'jax', 'tensorstore') "
             "if m in sys.modules]); sys.exit(code)")
    proc = subprocess.run(
        [sys.executable, "-c", probe, "submit", _config(tmp_path, good_model,
                                                        qwen_tokenizer_dir, hooks="")],
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 2 and "no hooks given" in proc.stderr, proc.stdout + proc.stderr
    assert "imported: []" in proc.stdout, proc.stdout


def test_checkpoint_checks_read_only_headers_on_gcs(gcs_bucket, good_model, tmp_path):
    """On gs:// the same checks run from ranged reads of each file's header (GCS's
    inclusive range end included), and a sound checkpoint passes."""
    from actx.schemas import store
    from actx.workers.model import checkpoint_check, families

    cfg = families.config_from_hf(json.load(open(os.path.join(good_model,
                                                                       "config.json"))))
    for name, local in (("good", good_model), ("truncated", _truncated(good_model, tmp_path))):
        remote = store.open_store(f"{gcs_bucket}/{name}")
        for f in os.listdir(local):
            remote.write(f, open(os.path.join(local, f), "rb").read())
    assert checkpoint_check.problems(f"{gcs_bucket}/good", cfg) == ([], [])
    found, _ = checkpoint_check.problems(f"{gcs_bucket}/truncated", cfg)
    size = os.path.getsize(os.path.join(good_model, "model.safetensors"))
    assert found == [f"spec.model.path: {gcs_bucket}/truncated/model.safetensors: "
                     f"{size - 1000:,} bytes, but its header describes {size:,}; the file is "
                     f"damaged or incomplete: download it again"]
    s = store.open_store(f"{gcs_bucket}/good")
    assert s.read_range("model.safetensors", 3, 11) == \
        open(os.path.join(good_model, "model.safetensors"), "rb").read()[3:11]
    assert s.size("nothing-here") is None



@pytest.fixture(scope="module")
def prepared_run(tmp_path_factory, qwen_tokenizer_dir) -> str:
    """A prepared run (4 partitions), nothing committed."""
    t = tmp_path_factory.mktemp("prepared")
    run = str(t / "run")
    proc = _actx("prepare", "--out", run, "--tokenizer", qwen_tokenizer_dir, "--text",
                 _texts(t), "--seq-len", "16", "--partition-rows", "4", "--rows-per-shard",
                 "2", "--runner=FnApiRunner")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run


def _no_data_run(prepared: str, tmp_path) -> str:
    """A run whose prepare accepted nothing, as an earlier actx could leave it (this one
    refuses to write it: see the prepare case)."""
    import dataclasses

    from actx.schemas import manifest, store

    run = _copy(prepared, tmp_path / "empty_run")
    s = store.open_store(run)
    m = manifest.read_manifest(s)
    manifest.write_manifest(s, dataclasses.replace(
        m, partitions=(), total_rows=0, total_tokens=0,
        sources={k: manifest.SourceCounts(v.read, 0, v.read) for k, v in m.sources.items()}))
    return run


def _leased_run(prepared: str, tmp_path) -> str:
    """A run another live job holds (its lease unexpired, its launcher this process)."""
    from actx.schemas import job_lease, store

    run = _copy(prepared, tmp_path / "leased_run")
    job_lease.acquire(store.open_store(run), job_lease.new(
        "other", ["local-r0h0", "local-r1h0"], "local", "Ctrl-C in its terminal"))
    return run


def _rejected_texts(tmp_path) -> str:
    path = tmp_path / "no_text.jsonl"
    path.write_text("".join(json.dumps({"body": f"document {i}"}) + "\n" for i in range(5)))
    return str(path)


# name -> (build(tmp_path, prepared_run, qwen_tok) -> argv, exit code, texts it must say)
NO_FALSE_SUCCESS = {
    "verify --only a partition that does not exist": (
        lambda t, r, q: ["verify", r, "--only", "1,99"], 2,
        ["--only: partition(s) [99] do not exist (the run has 4 partition(s), 0..3)"]),
    "rerun --only a partition that does not exist": (
        lambda t, r, q: ["rerun", r, "--only", "7"], 2,
        ["--only: partition(s) [7] do not exist"]),
    "prepare where every input is rejected": (
        lambda t, r, q: ["prepare", "--out", str(t / "run"), "--tokenizer", q, "--text",
                         _rejected_texts(t), "--max-reject-fraction=1",
                         "--runner=FnApiRunner"], 2,
        ["no input was accepted (5 of 5 rejected)"]),
    "verify a run that holds no data": (
        lambda t, r, q: ["verify", _no_data_run(r, t)], 1,
        ["the run holds no data: its prepare accepted none of its 8 input(s)"]),
    "status --check on a run that holds no data": (
        lambda t, r, q: ["status", _no_data_run(r, t), "--check"], 1, []),
    "rerun a run that holds no data": (
        lambda t, r, q: ["rerun", _no_data_run(r, t)], 2,
        ["the run holds no data: its prepare accepted no document"]),
    "rerun a run that another live job is extracting": (
        lambda t, r, q: ["rerun", _leased_run(r, t)], 2,
        ["another job is extracting this run: job other (local; hosts local-r0h0, "
         "local-r1h0;", "stop it with Ctrl-C in its terminal", "add --join"]),
}


@pytest.mark.parametrize("name", list(NO_FALSE_SUCCESS))
def test_no_false_success(name, tmp_path, prepared_run, qwen_tokenizer_dir):
    from actx.schemas import store

    build, code, expected = NO_FALSE_SUCCESS[name]
    before = store.open_store(prepared_run).list()
    proc = _actx(*build(tmp_path, prepared_run, qwen_tokenizer_dir))
    said = proc.stdout + proc.stderr
    FIGURES["tried"] += 1
    FIGURES["tracebacks"] += "Traceback" in said
    FIGURES["false_ok"] += proc.returncode == 0
    assert proc.returncode == code and "Traceback" not in said, said
    for text in expected:
        assert text in said, said
    assert store.open_store(prepared_run).list() == before  # nothing recorded
    if not (tmp_path / "run").exists() and code == 2 and "prepare" not in name:
        FIGURES["clear"] += 1  # refused before any work


def test_the_reader_on_a_run_with_nothing_committed_says_so_everywhere(prepared_run):
    import numpy as np

    from actx import reader

    run = reader.open_run(prepared_run)
    hook = "layers.0.resid_post"
    entry_points = {
        "hook": lambda: run.hook(hook), "rows": lambda: run.rows(hook, 0, 1),
        "tokens": lambda: run.tokens(hook, 0), "token_rows": lambda: run.token_rows(
            "input_ids", 0, 1),
        "gather": lambda: run.gather([hook], np.array([0]), np.array([0])),
        "gather of no tokens": lambda: run.gather([hook], np.array([], int),
                                                  np.array([], int)),
        "document": lambda: run.document(0), "select": lambda: run.select(hook, task="t"),
        "batches": lambda: run.batches(hook, 4), "stream": lambda: run.stream(hook, 4),
        "compute_stats": lambda: run.compute_stats(), "stats": lambda: run.stats(hook),
        "committed_ids": lambda: run.committed_ids()}
    said = set()
    for name, call in entry_points.items():
        with pytest.raises(reader.NothingCommittedError) as e:
            call()
        said.add(str(e.value))
    assert said == {f"{prepared_run}: nothing is committed yet (0 of 4 partitions), so no "
                    f"activation is readable; `actx status {prepared_run}` shows the "
                    f"extraction's progress, `actx rerun {prepared_run}` extracts them; then "
                    f"reopen the run (or call run.refresh())"}
    assert isinstance(e.value, reader.UnknownHookError)  # earlier handlers still hold
    assert run.hooks == {} and run.describe()["committed"] == []

def test_figures(request):
    """Runs last in this module: the figures of the cases above, in one line."""
    if FIGURES["tried"] < len(CASES) + len(NO_FALSE_SUCCESS):
        pytest.skip("not every case ran (-k, or a failure before it)")
    line = (f"bad inputs tried: {FIGURES['tried']}; clear exit 2 before work: "
            f"{FIGURES['clear']}; tracebacks: {FIGURES['tracebacks']}; false OK: "
            f"{FIGURES['false_ok']}")
    after = FIGURES["tried"] - FIGURES["clear"]
    if after:  # faults only work can find, or checks that fail: exit 1 or 2, never 0
        line += (f" (the other {after}: a check that fails, exit 1, or a refusal after the "
                 f"work that finds it, exit 2)")
    print("\n" + line)

    class _Summary:
        def pytest_terminal_summary(self, terminalreporter):
            terminalreporter.write_sep("-", "bad inputs")
            terminalreporter.write_line(line)

    request.config.pluginmanager.register(_Summary(), "actx-bad-input-figures")
    assert FIGURES["tracebacks"] == 0 and FIGURES["false_ok"] == 0
    assert FIGURES["clear"] >= len(CASES)

