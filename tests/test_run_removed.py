"""Nothing a user removes leaves a run that says finished (issue 66, item 1).

A run's activations/ removed under a live job: the worker refuses to commit into it (its
marker would vouch for data that is gone), the launcher exits 1 and names the commands
that finish it, status, verify and the reader say what is missing, and those commands,
followed as printed, give a complete, verified run. A run directory removed (a few
markers written again by the job's last writes): submitting the same config again
prepares it afresh and extracts every partition. Real worker processes and a real
prepare, on tiny random Qwen2 models."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from actx.deploy import cli, demo
from actx.schemas import commit, errors, layout, store
from tests import hf_models, token_runs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = re.compile(r"`(actx [^`]*)`")


def _cli(*argv) -> tuple[int, str]:
    out = io.StringIO()
    return cli.main([str(a) for a in argv], out=out), out.getvalue()


def _remove(path: str) -> None:
    """rm -r, as a user does, while a worker may still be writing inside."""
    for _ in range(50):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path) or not os.path.exists(os.path.join(path, "actx.json")):
            return
        time.sleep(0.01)


def test_activations_removed_under_a_live_job(tmp_path):
    model = hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", num_hidden_layers=2)
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, str(model), n_rows=1536, seq_len=128, partition_rows=64,
                               rows_per_shard=8)  # 24 partitions
    s = store.open_store(run)
    proc = subprocess.Popen(
        [sys.executable, "-m", "actx.deploy.cli", "rerun", run, "--hosts", "1",
         "--batch-size", "8", "--job", "removed"], cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while not commit.committed_partitions(s, 24):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    _remove(os.path.join(run, "activations"))
    said, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, said
    assert "phase:      finished" not in said and "every partition is committed" not in said
    assert "removed while this worker extracted" in said, said
    committed = commit.committed_partitions(s, 24)
    assert 0 < len(committed) < 24, said  # none after the removal was seen
    last = said.rstrip().splitlines()[-1]
    assert last.startswith(f"extract: {run} lost activations/actx.json"), last
    advice = COMMAND.findall(last)
    assert advice == [f"actx verify {run} --repair", f"actx rerun {run}"], last

    # What is missing, said by the reader and verify.
    from actx import reader
    with pytest.raises(errors.NotARunError, match=re.escape(f"actx verify {run} --repair")):
        reader.open_run(run).hooks
    code, out = _cli("status", run)
    assert code == 0 and (f"phase:      failed: activations/actx.json is missing, but "
                          f"{len(committed)} partition(s) are committed") in out, out
    assert COMMAND.findall(out.splitlines()[1]) == advice
    code, out = _cli("status", run, "--json")
    assert json.loads(out)["phase"] == "failed" and "--repair" in json.loads(out)["problem"]
    from actx.deploy.page import data as ui_data
    from actx.deploy.status import runstate
    from actx.schemas import run_dir
    page = ui_data.page_data(runstate.compute_status(run_dir.open_run(run)))
    assert page["phase"] == "failed" and page["commands"]["repair"] == advice[0]
    assert page["commands"]["rerun_all"] == advice[1] and "read" not in page["commands"]
    # The advice, followed as printed, finishes the run.
    code, out = _cli(*shlex.split(advice[0])[1:])
    assert code == 1 and f"REPAIRED: {len(committed)} partition(s)" in out, out
    code, out = _cli(*shlex.split(advice[1])[1:])
    assert code == 0, out
    code, out = _cli("verify", run)
    assert code == 0 and "OK: every committed block matches its checksum" in out, out
    assert len(commit.committed_partitions(s, 24)) == 24


def _submit_config(tmp_path, qwen_tokenizer_dir, seq_len: int = 32):
    """A config of a tiny random Qwen2 over 40 short notes, and its run's path."""
    model = tmp_path / "model"
    if not model.exists():
        demo.make_tiny_qwen2(str(model), seed=0)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(qwen_tokenizer_dir, name), model / name)
        (tmp_path / "notes.jsonl").write_text("".join(
            json.dumps({"text": f"note {i} " + "words " * (i % 9)}) + "\n" for i in range(40)))
    config = tmp_path / f"c{seq_len}.yaml"
    config.write_text(
        f"run: {tmp_path / 'run'}\n"
        f"spec:\n  model: {{path: {model}, dtype: float32}}\n  tokenizer: {{path: {model}}}\n"
        f"  sources: [{{kind: text, paths: [{tmp_path / 'notes.jsonl'}]}}]\n"
        f"  packing: {{mode: segmented, seq_len: {seq_len}}}\n"
        f"  capture: {{hooks: layers.0.resid_post, dtype: float32}}\n"
        f"  layout: {{rows_per_shard: 4, partition_rows: 8}}\n"
        f"target: {{kind: local, hosts: 1, batch_size: 4}}\n")
    return config, str(tmp_path / "run")


def _stored(run: str) -> dict[str, bytes]:
    """Every file of the run's activations and commits, by path."""
    return {os.path.relpath(os.path.join(d, f), run): open(os.path.join(d, f), "rb").read()
            for top in ("activations", "commits")
            for d, _, files in os.walk(os.path.join(run, top)) for f in files}


def test_a_run_json_deleted_alone_is_written_again_and_nothing_extracted_again(
        tmp_path, qwen_tokenizer_dir, capsys, monkeypatch):
    """A fault audit deleted run.json alone: every command said the run's data was gone,
    and the submit they advised cleared the markers and extracted everything again. The
    manifest (its fingerprint) and the markers stand: the submit of the config the run
    was made with prepares it again, checked against what is committed, writes run.json
    and keeps every partition; a config of another spec is refused, nothing deleted."""
    config, run = _submit_config(tmp_path, qwen_tokenizer_dir)
    code, out = _cli("submit", config)
    assert code == 0, out
    spec_bytes = open(os.path.join(run, "run.json"), "rb").read()
    before = _stored(run)
    os.remove(os.path.join(run, "run.json"))
    for argv in (["status", run], ["verify", run]):
        proc = subprocess.run([sys.executable, "-m", "actx.deploy.cli", *argv], cwd=REPO,
                              text=True, capture_output=True, timeout=120)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "run.json is gone, but manifest.json (fingerprint " in proc.stderr
        assert f"(its last launch's was {config})" in proc.stderr, proc.stderr
        assert "data is gone" not in proc.stderr
    other, _ = _submit_config(tmp_path, qwen_tokenizer_dir, seq_len=64)
    capsys.readouterr()
    code, _ = _cli("submit", other)
    said = capsys.readouterr().err
    assert code == 2 and "holds a different run (its manifest.json has fingerprint" in said
    assert _stored(run) == before
    # That prepare stopped on the way (after its checks, before Beam ran): the run is left
    # as a prepare again leaves it, and the next submit still keeps every partition.
    from actx.pipeline import beam_pipeline

    def stopped(*args, **kwargs):
        raise RuntimeError("stopped on the way")

    with monkeypatch.context() as patched:
        patched.setattr(beam_pipeline, "build", stopped)
        with pytest.raises(RuntimeError, match="stopped on the way"):
            _cli("submit", config)
    assert not os.path.exists(os.path.join(run, "manifest.json"))
    with pytest.raises(errors.NotARunError, match="the run was being prepared again"):
        from actx import reader
        reader.open_run(run)
    assert _stored(run) == before
    code, out = _cli("submit", config)
    assert code == 0 and "nothing to do" in out and "starts afresh" not in out, out
    assert open(os.path.join(run, "run.json"), "rb").read() == spec_bytes
    assert _stored(run) == before
    code, out = _cli("verify", run)
    assert code == 0 and "OK: every committed block matches its checksum" in out, out

    # Damaged rather than deleted (cut short: not JSON), run.json or manifest.json: each
    # command names what writes it again, and that, followed, keeps every partition.
    for name in ("run.json", "manifest.json"):
        path = os.path.join(run, name)
        whole = open(path, "rb").read()
        open(path, "wb").write(whole[:len(whole) // 2])
        proc = subprocess.run([sys.executable, "-m", "actx.deploy.cli", "status", run],
                              cwd=REPO, text=True, capture_output=True, timeout=120)
        assert proc.returncode == 2 and f"{path}: not valid JSON" in proc.stderr, proc.stderr
        assert "keeps every committed partition" in proc.stderr, proc.stderr
        [advised] = COMMAND.findall(proc.stderr)
        if name == "run.json":
            assert advised == "actx submit" and f"(its last launch's was {config})" in \
                proc.stderr, proc.stderr
            code, out = _cli("submit", config)
        else:
            assert advised == f"actx prepare --out {run} --spec {run}/run.json", proc.stderr
            code, out = _cli(*shlex.split(advised)[1:])
        assert code == 0, out
        assert open(path, "rb").read() == whole
        assert _stored(run) == before


def test_submitting_again_over_a_removed_run_directory_starts_afresh(tmp_path, monkeypatch,
                                                                       qwen_tokenizer_dir):
    config, run = _submit_config(tmp_path, qwen_tokenizer_dir)
    code, out = _cli("submit", config)
    assert code == 0, out
    n = len(json.load(open(os.path.join(run, "manifest.json")))["partitions"]["id"])
    marker = open(os.path.join(run, layout.commit_key(0)), "rb").read()
    shutil.rmtree(run)
    # The job's last writes after the removal: a marker (and its activations) again.
    os.makedirs(os.path.join(run, "commits"))
    open(os.path.join(run, layout.commit_key(0)), "wb").write(marker)
    # What status, verify and the reader say: the run's files are gone, and what to type.
    for argv in (["status", run], ["verify", run]):
        proc = subprocess.run([sys.executable, "-m", "actx.deploy.cli", *argv], cwd=REPO,
                              text=True, capture_output=True, timeout=120)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "was removed while a job ran" in proc.stderr and "`actx submit`" in proc.stderr
    from actx import reader
    with pytest.raises(errors.NotARunError, match="removed while a job ran"):
        reader.open_run(run)
    code, out = _cli("submit", config)
    assert code == 0, out
    assert "nothing to do" not in out and "the run starts afresh" in out, out
    assert "phase:      finished" in out
    assert len(commit.committed_partitions(store.open_store(run), n)) == n
    code, out = _cli("verify", run)
    assert code == 0 and "OK: every committed block matches its checksum" in out, out
