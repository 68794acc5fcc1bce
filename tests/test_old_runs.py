"""Runs written before a change open, verify, rerun and read exactly as before.

tests/old_runs/v0.1.0 holds a run directory actx 0.1.0 wrote when its packages were still
installed at the top level (`import reader`, `python -m workers.main`), before they became
one package, actx (issue 43). The run directory is a public contract: nothing in it may
depend on where actx's modules live. Each test works on a copy, so the committed run stays
as the old version left it.
"""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import actx

OLD = pathlib.Path(__file__).resolve().parent / "old_runs" / "v0.1.0"
# Where the old run's run.json says its model, tokenizer and texts are (absolute, as
# actx records them): a rerun reads the same model from there.
INPUTS_AT = pathlib.Path("/tmp/actx-old-run-v0.1.0")
INPUTS = ("model", "tokenizer", "texts.jsonl")
HOOKS = ("layers.0.resid_post", "layers.1.resid_post")


def _same_inputs(where: pathlib.Path) -> bool:
    for name in INPUTS:
        a, b = OLD / name, where / name
        if a.is_dir():
            if not b.is_dir():
                return False
            cmp = filecmp.dircmp(a, b)
            if cmp.left_only or cmp.right_only or any(
                    not filecmp.cmp(a / f, b / f, shallow=False) for f in cmp.common_files):
                return False
        elif not (b.is_file() and filecmp.cmp(a, b, shallow=False)):
            return False
    return True


@pytest.fixture(scope="module")
def old_inputs() -> pathlib.Path:
    """The old run's inputs at the absolute path its run.json names (laid out once,
    atomically, and replaced if something else is there)."""
    if not _same_inputs(INPUTS_AT):
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".actx-old-run-", dir=INPUTS_AT.parent))
        for name in INPUTS:
            (shutil.copytree if (OLD / name).is_dir() else shutil.copy2)(OLD / name, tmp / name)
        shutil.rmtree(INPUTS_AT, ignore_errors=True)
        try:
            os.rename(tmp, INPUTS_AT)
        except OSError:  # another process laid them out first
            shutil.rmtree(tmp, ignore_errors=True)
        assert _same_inputs(INPUTS_AT), f"{INPUTS_AT} holds other inputs than {OLD}"
    return INPUTS_AT


@pytest.fixture
def old_run(tmp_path) -> pathlib.Path:
    run = tmp_path / "run"
    shutil.copytree(OLD / "run", run)
    return run


def _cli(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "actx.deploy.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def _digest(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    return {"sha256": hashlib.sha256(a.tobytes()).hexdigest(), "shape": list(a.shape),
            "dtype": str(a.dtype)}


def _files(root: pathlib.Path, under: str) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted((root / under).rglob("*")) if p.is_file()}


def test_the_old_run_reads_as_the_old_reader_read_it(old_run):
    """The same reads, through `import actx`, give the bytes actx 0.1.0's reader gave."""
    expected = json.loads((OLD / "expected_reads.json").read_text())
    r = actx.open_run(str(old_run))
    assert sorted(r.hooks) == expected["describe_hooks"] == list(HOOKS)
    for hook in HOOKS:
        assert _digest(r.rows(hook, 0, r.total_rows)) == expected[f"rows:{hook}"], hook
    assert _digest(r.token_rows("input_ids", 0, r.total_rows)) == \
        expected["token_rows:input_ids"]
    doc = r.document(3)
    got = {"rows": _digest(doc.rows), "cols": _digest(doc.cols),
           "input_ids": _digest(doc.input_ids),
           **{f"acts:{k}": _digest(v) for k, v in sorted(doc.acts.items())}, "meta": doc.meta}
    assert got == expected["document:3"]
    batches = [_digest(b.acts["layers.1.resid_post"])["sha256"]
               for b in r.batches("layers.1.resid_post", batch_size=16, seed=0, epochs=1)]
    assert batches == expected["batches:layers.1.resid_post:seed0"]


def test_the_old_run_is_complete_and_verifies(old_run, tmp_path):
    status = _cli("status", old_run, "--json", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    obj = json.loads(status.stdout)
    assert obj["complete"] and obj["counts"]["committed"] == 5, obj["counts"]
    verify = _cli("verify", old_run, "--json", cwd=tmp_path)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    report = json.loads(verify.stdout)
    assert report["ok"] and not report["problems"], report


def test_the_old_run_reruns_a_lost_partition_to_the_same_bytes(old_run, old_inputs, tmp_path):
    """A partition of the old run lost (its commit marker and its stored activations) is
    extracted again by this actx from the old run's own run.json, to the bytes the old
    version committed where this machine's XLA computes as the writer's did; the
    fingerprint and activations/actx.json stay as they were.

    XLA compiles CPU code for the processor it runs on (AVX-512 or not, FMA contraction),
    so float32 sums may round differently in their last bits on another machine: measured
    on an AMD EPYC with AVX-512, 1.1e-8 apart on values up to 0.06 (under 2 float32 epsilons
    of the row's scale). There the lost partition's activations (and only they) must be
    within float32 rounding of the old ones, the same again when lost and extracted a
    second time, and what verify reads from the new marker."""
    before = {**_files(old_run, "activations"), **_files(old_run, "commits"),
              "run.json": (old_run / "run.json").read_bytes()}
    spec = json.loads((old_run / "run.json").read_text())
    assert spec["model"]["path"] == str(old_inputs / "model")
    commit = json.loads((old_run / "commits" / "p-00002.json").read_text())
    shard_rows = spec["layout"]["rows_per_shard"]
    shards = range(commit["row_start"] // shard_rows,
                   (commit["row_start"] + commit["row_count"]) // shard_rows)
    (old_run / "commits" / "p-00002.json").unlink()
    for hook in HOOKS:
        for shard in shards:
            shutil.rmtree(old_run / "activations" / hook / "c" / str(shard))

    assert json.loads(_cli("status", old_run, "--json", cwd=tmp_path).stdout)["complete"] \
        is False
    # As status advises it, with no flags: the old run recorded no launch, so the rerun
    # takes the batch size its activations were computed with (2 rows a device, not the
    # default 8, which the worker would refuse: other rows per device, other bytes).
    rerun = _cli("rerun", old_run, cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "p-00002" in rerun.stdout
    assert "as the run's activations were computed (activations/actx.json): batch_size 2" \
        in rerun.stdout, rerun.stdout

    after = {**_files(old_run, "activations"), **_files(old_run, "commits"),
             "run.json": (old_run / "run.json").read_bytes()}
    assert after.keys() == before.keys()
    changed = sorted(k for k in before if before[k] != after[k])
    lost = {f"activations/{hook}/c/{shard}/0/0" for hook in HOOKS for shard in shards}
    # Only the new commit marker differs (its attempt, time and code version), and not in
    # what it says of the data; on a machine whose XLA rounds otherwise, the lost
    # partition's chunks too, and nothing else.
    exact = changed == ["commits/p-00002.json"]
    assert set(changed) <= lost | {"commits/p-00002.json"}, changed
    old_commit = json.loads(before["commits/p-00002.json"])
    new_commit = json.loads(after["commits/p-00002.json"])
    for key in ("checksums",) * exact + ("fingerprint", "row_start", "row_count", "tokens",
                                          "dtypes"):
        assert new_commit[key] == old_commit[key], key
    if not exact:
        rows = slice(commit["row_start"], commit["row_start"] + commit["row_count"])
        old_acts, new_acts = actx.open_run(str(OLD / "run")), actx.open_run(str(old_run))
        for hook in HOOKS:
            was = np.asarray(old_acts.rows(hook, rows.start, rows.stop), np.float32)
            now = np.asarray(new_acts.rows(hook, rows.start, rows.stop), np.float32)
            scale = np.abs(was).max(axis=(1, 2), keepdims=True)
            assert np.all(np.abs(now - was) <= 16 * np.finfo(np.float32).eps * scale), hook
        # Deterministic here: lost again and extracted again, the same bytes.
        (old_run / "commits" / "p-00002.json").unlink()
        for key in lost:
            (old_run / key).unlink()
        again = _cli("rerun", old_run, cwd=tmp_path)
        assert again.returncode == 0, again.stdout + again.stderr
        assert {k: v for k, v in _files(old_run, "activations").items() if k in lost} == \
            {k: after[k] for k in lost}
    verify = _cli("verify", old_run, "--json", cwd=tmp_path)
    assert verify.returncode == 0 and json.loads(verify.stdout)["ok"], verify.stdout
