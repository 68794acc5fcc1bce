"""The advice actx prints after a failure, followed exactly as printed, finishes the run:
every command that `actx status`, the live page's data and the launcher name is parsed
from their output and run through the CLI's entry point; then the run is complete, and no
failure banner or rerun advice remains. Cases: a dead worker of a job whose replicas
share work (it had claimed partitions ahead, which read as pending), and a verify that
fails. (A Ctrl-C is followed in tests/test_terminal_story.py; a SIGKILLed worker under a
real launcher in tests/test_ops_dead_worker.py.) Real worker processes on a tiny random
Qwen2; the dead worker's traces are written as a killed worker leaves them.

Every command actx advises is made by schemas.advice from its table of kinds; the tests here
hold that table against the code (no advice made elsewhere) and against where each kind is
followed as printed, per target (tests/advice_follow.py's FOLLOWED_IN)."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import json
import os
import re
import shlex
import subprocess
import sys
import time

import numpy as np
import pytest

from actx.deploy import cli, local
from actx.deploy.page import data as ui_data
from actx.deploy.status import runstate
from actx.deploy.status import text as status_text
from actx.deploy.targets import local as local_target
from actx.schemas import advice, commit, config as config_lib, heartbeat, layout, store
from actx.schemas import run_dir
from tests import advice_follow, hf_models, token_runs, worker_procs
from tests.advice_follow import follow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEAD_JOB, DEAD_HOST = "local-20260101-000000", "local-r1h0"


def _advice(text: str) -> set[str]:
    """The commands a text tells its reader to type, as they are written."""
    return {command for _, command in advice.find(text)}


def _everything_said(run: str) -> tuple[str, dict]:
    """`actx status` as text and the page's data, of the run as it stands."""
    out = io.StringIO()
    assert cli.main(["status", run], out=out) == 0
    return out.getvalue(), ui_data.page_data(runstate.compute_status(run_dir.open_run(run)))


def _gone_pid() -> int:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    return ended.pid


@pytest.fixture
def run(tmp_path) -> str:
    model = hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", num_hidden_layers=1)
    path = str(tmp_path / "run")
    token_runs.write_token_run(path, str(model), n_rows=32, seq_len=16, partition_rows=8,
                               rows_per_shard=4)  # 4 partitions
    return path


def _kill_a_stealing_worker(run: str) -> None:
    """What a SIGKILLed replica of a two-replica job leaves: its heartbeat still says
    working on p-00001 (its process gone) and holding p-00002, claimed ahead (it would
    have been next), and its launcher's record of the death (local.mark_dead)."""
    s = store.open_store(run)
    attempt = f"{DEAD_HOST}-{_gone_pid()}-dead0001"
    beat = heartbeat.Heartbeat(host=DEAD_HOST, replica=1, process_index=0, state="working",
                               attempt=attempt, updated_at=time.time(), partition=1, step=1,
                               steps=2, tokens_done=40, tokens_per_s=400.0, held=(1, 2),
                               machine=heartbeat.this_machine(),
                               pid=int(attempt.split("-")[-2]), job=DEAD_JOB)
    s.write_json(layout.heartbeat_key(DEAD_HOST), config_lib.to_dict(beat))
    for p in (1, 2):
        assert s.create_json(layout.claim_key(DEAD_JOB, p), {"attempt": attempt, "at": 0})
    assert local.mark_dead(run, DEAD_HOST, -9, None)


def test_a_dead_worker_with_claims_ahead_is_finished_by_what_every_view_advises(run):
    _kill_a_stealing_worker(run)
    status = runstate.compute_status(run_dir.open_run(run))
    assert status.phase == "failed"
    # What it held, the partition in hand and the one claimed ahead, is stale at once.
    assert status.partitions.named() == {"p-00000": "pending", "p-00001": "stale",
                                         "p-00002": "stale", "p-00003": "pending"}
    launcher = io.StringIO()
    assert local_target._rerun_hint(run_dir.open_run(run), status, None, launcher)
    text, page = _everything_said(run)
    [host] = page["hosts"]
    assert host["dead"] and "killed by SIGKILL" in host["message"]
    views = "\n".join([launcher.getvalue(), text, host["message"],
                        *page["commands"].values()])
    advised = _advice(views)
    # One command everywhere, and not `--only stale`: that would leave p-00000 and p-00003
    # pending and answer "nothing to do" on the next try.
    assert advised == {f"actx rerun {run}", f"actx verify {run}",
                       f"actx status {run} --json"}, advised

    code, said = follow(views, "rerun")
    assert code == 0, said
    s = store.open_store(run)
    assert sorted(commit.committed_partitions(s, 4)) == [0, 1, 2, 3]

    # Finished: no failure banner, no advice to rerun, in status, --json or the page; the
    # dead host's record stays (what happened), without its command.
    text, page = _everything_said(run)
    assert "phase:      finished" in text and "actx rerun" not in text, text
    assert page["phase"] == "finished" and "rerun_all" not in page["commands"]
    assert not any(h["dead"] for h in page["hosts"])
    dead = next(h for h in page["hosts"] if h["host"] == DEAD_HOST)
    assert "killed by SIGKILL" in dead["message"] and "actx rerun" not in dead["message"]
    # The page's command for a script: the run's status as JSON, finished.
    code, said = follow("\n".join(page["commands"].values()), "status_json")
    assert code == 0 and json.loads(said)["phase"] == "finished"
    assert "actx rerun" not in said
    # What status says of a verify that has not run yet, followed: the run verifies, and
    # status says so.
    code, said = follow(text, "verify")
    assert code == 0 and "OK: every committed block matches its checksum" in said, said
    text, page = _everything_said(run)
    assert "not run yet" not in text and page["verification"]["ok"]
    # The page's reader command, in a fresh interpreter: the run's description.
    code, said = follow(page["commands"]["read"], "read")
    assert code == 0 and "layers.0.resid_post" in said, said


def test_a_failed_verify_is_finished_by_the_commands_it_prints(run):
    assert cli.main(["rerun", run], out=io.StringIO()) == 0
    # One stored chunk of p-00002's rows damaged on disk, as a bad disk would.
    chunk = _a_chunk_of(run, row_start=16)
    with open(chunk, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0xFF
        f.seek(0)
        f.write(data)
    code, said = cli.main(["verify", run], out=(out := io.StringIO())), out.getvalue()
    assert code == 1 and "FAILED" in said
    text, page = _everything_said(run)
    assert "failed the latest `actx verify`" in text
    # verify -> verify --repair -> rerun -> verify: each printed by the one before.
    assert _advice(said) == {f"actx verify {run} --repair", f"actx rerun {run}"}, said
    code, said = follow(said, "repair")
    assert code == 1 and "REPAIRED: 1 partition(s)" in said, said
    rerun = advice_follow.advised(said, "rerun")
    text, _ = _everything_said(run)
    assert advice_follow.advised(text, "rerun") == rerun  # status says the same now
    code, said = follow(said, "rerun")
    assert code == 0, said
    code, said = follow(said, "verify")  # the rerun's "check them:"
    assert code == 0 and "OK: every committed block matches its checksum" in said, said
    text, page = _everything_said(run)
    assert "phase:      finished" in text and "actx rerun" not in text
    assert page["verification"]["ok"] and "rerun_all" not in page["commands"]


def test_a_lost_object_is_refused_by_the_reader_and_its_advice_restores_the_values(run):
    """A committed partition's activation object deleted after its commit would read as
    zeros: the reader refuses it by name, and its advice, followed as printed, extracts
    it again with the values it had."""
    from actx import reader

    assert cli.main(["rerun", run], out=io.StringIO()) == 0
    opened = reader.open_run(run)
    hook = sorted(opened.hooks)[0]
    before = opened.rows(hook, 0, 32)
    os.remove(_a_chunk_of(run, row_start=16))  # rows 16..19: p-00002
    opened = reader.open_run(run)
    np.testing.assert_array_equal(opened.rows(hook, 0, 16), before[:16])
    with pytest.raises(reader.LostDataError) as e:
        list(opened.stream(hook, 16, seed=0, epochs=1))
    said = str(e.value)
    assert "(p-00002)" in said and _advice(said) == {f"actx verify {run} --repair",
                                                      f"actx rerun {run}"}, said
    code, said = follow(said, "repair")
    assert code == 1 and "REPAIRED: 1 partition(s)" in said, said
    code, said = follow(str(e.value), "rerun")
    assert code == 0, said
    np.testing.assert_array_equal(reader.open_run(run).rows(hook, 0, 32), before)


def _a_chunk_of(run: str, row_start: int) -> str:
    """The file of the first hook's chunk that starts at `row_start`."""
    root = os.path.join(run, layout.ACTIVATIONS_GROUP)
    hook = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))[0]
    info = store.open_store(run).read_json(f"{layout.ACTIVATIONS_GROUP}/{hook}/zarr.json")
    chunk_rows = info["chunk_grid"]["configuration"]["chunk_shape"][0]
    path = os.path.join(root, hook, "c", str(row_start // chunk_rows), "0", "0")
    assert os.path.isfile(path), sorted(os.listdir(os.path.join(root, hook)))
    return path


def test_a_stop_signal_reads_as_stopped_not_failed(run):
    """A worker's loop ended by a stop signal records a stop (also a second signal that
    raises at once); a launcher's record after Ctrl-C turns an older worker's "failed ...
    Stopped: SIGTERM" into stopped too; status and the page then say stopped."""
    import signal

    from actx.schemas import stop_signals
    from actx.workers.loop import runner

    assert runner.ended_by(stop_signals.Stopped(signal.SIGTERM)) == {
        "state": "preempted", "message": "stopped by SIGTERM; nothing partial was committed"}
    assert runner.ended_by(KeyboardInterrupt())["state"] == "preempted"
    assert runner.ended_by(ValueError("x")) == {"state": "failed", "message": "ValueError: x"}

    s = store.open_store(run)
    old = heartbeat.Heartbeat(host="local-r0h0", replica=0, process_index=0, state="failed",
                              attempt="a", updated_at=time.time(), partition=0,
                              message="Stopped: SIGTERM", job="j")
    s.write_json(layout.heartbeat_key("local-r0h0"), config_lib.to_dict(old))
    assert local.mark_dead(run, "local-r0h0", -15, stopped_by_user=True)
    text, page = _everything_said(run)
    assert "phase:      stopped" in text and "failed" not in text.split("hosts")[1]
    assert [h["state"] for h in page["hosts"]] == ["stopped"]
    assert page["phase"] == "stopped" and not page["hosts"][0]["dead"]
    assert f"`actx rerun {run}` finishes" in text
    # A real failure stays a failure.
    s.write_json(layout.heartbeat_key("local-r0h0"), config_lib.to_dict(
        dataclasses.replace(old, message="RuntimeError: out of memory")))
    assert not local.mark_dead(run, "local-r0h0", -15, stopped_by_user=True)
    assert runstate.compute_status(run_dir.open_run(run)).phase == "failed"


def test_status_line_of_a_finished_run_keeps_no_advice(run):
    """Every partition committed (markers only): a failed host's advice is gone from the
    hosts' messages, the phase note and the page's commands."""
    _kill_a_stealing_worker(run)
    s = store.open_store(run)
    # What the workers write before any data; without it the markers would vouch for
    # activations that are gone (status then says failed, tests/test_run_removed.py).
    from actx.schemas import activations_info
    spec = run_dir.open_run(run).spec
    activations_info.create_info(s, activations_info.ActivationsInfo(
        spec.fingerprint, spec.capture.dtype, {"layers.0.resid_post": 8}))
    for p in range(4):
        s.create_json(layout.commit_key(p), {"partition": p})
    status = runstate.compute_status(run_dir.open_run(run))
    assert status.phase == "finished"
    [h] = status.hosts
    assert "killed by SIGKILL" in h.message and "actx rerun" not in h.message
    assert "actx rerun" not in status_text.render(status)


def test_every_kind_of_advice_is_followed_where_it_is_printed():
    """The registry's kinds, each with a situation per target that prints it: a test that
    follows that kind as printed (`follow(text, kind)`); no kind without one."""
    assert set(advice_follow.FOLLOWED_IN) == set(advice.KINDS), (
        "kinds of advice no test follows: "
        f"{sorted(set(advice.KINDS) - set(advice_follow.FOLLOWED_IN))}")
    for kind, where in advice_follow.FOLLOWED_IN.items():
        assert where and set(where) <= {"local", "slurm", "tpu-vm"}, (kind, where)
        for target, node in where.items():
            path, name = node.split("::")
            tree = ast.parse(open(os.path.join(REPO, path)).read())
            [test] = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == name]
            calls = [c for c in ast.walk(test) if isinstance(c, ast.Call)
                     and getattr(c.func, "id", getattr(c.func, "attr", None)) == "follow"
                     and len(c.args) >= 2 and isinstance(c.args[1], ast.Constant)]
            assert kind in {c.args[1].value for c in calls}, (
                f"{node} ({target}) does not follow advice of kind {kind!r} as printed")


def test_find_tells_every_kind_apart():
    """Each kind's command, printed among others, is found as that kind, whole."""
    fields = {"run": "/r/x", "target": "slurm", "config": "/c/s.yaml",
              "spec": "/r/x/run.json"}
    for name, kind in advice.KINDS.items():
        command = advice.command(name, **{k: v for k, v in fields.items()
                                          if "{" + k + "}" in kind.template})
        text = f"phase: failed; `{command}` does it; then `actx status /r/x --watch`"
        assert advice.find(text)[0] == (name, command), (name, advice.find(text))


@pytest.mark.parametrize("path", ["/runs/ünï cødé 数据/run dir", "/runs/it's here",
                                  '/runs/$HOME "q"`x`!\\/r', "gs://bucket/runs/r1"])
def test_a_path_the_shell_would_split_is_one_word_of_the_command_as_printed(path, tmp_path):
    """A fault audit pasted `actx rerun /tmp/.../ünï cødé 数据/run dir` as printed: exit 2
    (three words). Each kind's command, run by a real shell as printed (actx and python
    replaced by what prints the words they get), hands each path on exactly."""
    import subprocess

    fields = {"run": path, "target": "slurm", "config": f"{path}/c.yaml",
              "spec": f"{path}/run.json"}
    words = tmp_path / "words.py"
    words.write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    shell = f"actx() {{ python3 {words} \"$@\"; }}; python() {{ python3 {words} \"$@\"; }}; "
    for name, kind in advice.KINDS.items():
        given = {k: v for k, v in fields.items() if "{" + k + "}" in kind.template}
        command = advice.command(name, **given)
        done = subprocess.run(["bash", "-c", shell + command], capture_output=True, text=True)
        assert done.returncode == 0, (command, done.stderr)
        got = json.loads(done.stdout)
        if name == "read":  # python -c CODE: the code opens the path itself
            assert got[0] == "-c", got
            call = ast.parse(got[1]).body[1].value.args[0].func.value
            assert ast.literal_eval(call.args[0]) == path, got[1]
            continue
        # The template's words, each field one word, as the shell gives them.
        want = [fields[w[1:-1]] if w.startswith("{") else w
                for w in kind.template.split()[1:]]
        assert got == want, (command, got)
    assert advice.find(f"run `{advice.rerun(path)}` now") == [("rerun", advice.rerun(path))]


# Advice made outside the registry: an f-string (or a template) that writes an actx command
# with a field in it (a run, a config).
_MADE_HERE = re.compile(r"actx (?:(?:rerun|verify|status|down) |prepare --)[^`\"'\n]*\{")


def _advice_made_elsewhere(root: str) -> list[str]:
    found = []
    for top in ("deploy", "pipeline", "workers", "reader", "schemas", "adapters"):
        for directory, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                path = os.path.join(directory, name)
                if not name.endswith(".py") or path.endswith(os.path.join("schemas", "advice.py")):
                    continue
                tree = ast.parse(open(path).read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.JoinedStr):
                        text = "".join(v.value if isinstance(v, ast.Constant) else "{}"
                                       for v in node.values)
                    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                        text = node.value
                    else:
                        continue
                    if _MADE_HERE.search(text):
                        found.append(f"{os.path.relpath(path, root)}:{node.lineno}")
    return sorted(set(found))


def test_every_piece_of_advice_is_made_by_the_registry():
    assert _advice_made_elsewhere(REPO) == []


def test_the_scan_sees_advice_made_elsewhere(tmp_path):
    bad = tmp_path / "deploy" / "bad.py"
    bad.parent.mkdir()
    bad.write_text('A = f"`actx rerun {run}` finishes it"\n'
                   'B = "nothing was recorded; `actx verify {run}` checks it again"\n'
                   'C = f"`{advice.rerun(run)}` finishes it"\n')
    assert _advice_made_elsewhere(str(tmp_path)) == ["deploy/bad.py:1", "deploy/bad.py:2"]


def test_the_readers_advice_on_a_run_not_extracted_yet_finishes_it(run):
    """A prepared run opened by the reader before any partition is committed: the error
    names the command that shows the run's progress and the one that extracts it, each
    followed as printed; then the run reads."""
    from actx import reader
    from actx.reader import errors

    with pytest.raises(errors.NothingCommittedError) as e:
        reader.open_run(run).rows("layers.0.resid_post", 0, 1)
    said = str(e.value)
    code, status_said = follow(said, "status")
    assert code == 0 and "0 committed" in status_said, status_said
    code, rerun_said = follow(said, "rerun")
    assert code == 0, rerun_said
    assert reader.open_run(run).rows("layers.0.resid_post", 0, 1).shape[0] == 1


def test_a_moved_model_is_said_before_any_worker_and_its_advice_finishes_the_run(run, tmp_path):
    """The checkpoint directory moved after prepare (run.json keeps its path, part of the
    run): the rerun refuses before starting a worker, in one line saying where the run
    reads the model and what to put there; done as said (a link to where it is now), the
    same rerun finishes the run."""
    model = json.loads(open(os.path.join(run, "run.json")).read())["model"]["path"]
    moved = str(tmp_path / "elsewhere")
    os.rename(model, moved)
    out = io.StringIO()
    assert cli.main(["rerun", run], out=out) == 2
    assert not os.path.isdir(os.path.join(run, "logs")) or not any(
        name.startswith("rerun-") for name in os.listdir(os.path.join(run, "logs")))
    os.symlink(moved, model)
    assert cli.main(["rerun", run], out=out) == 0, out.getvalue()
    assert runstate.compute_status(run_dir.open_run(run)).complete


def _own_data_config(tmp_path, qwen_tokenizer_dir, extra_lines=()):
    """README's own-data setup in `tmp_path`: a tiny Qwen2 with Qwen's tokenizer in
    model/, 24 notes (and `extra_lines`) in notes.jsonl, and my-run.yaml extracting them
    into run/ on the local target. Returns the model's directory."""
    import shutil

    from actx.deploy import demo

    model = tmp_path / "model"
    demo.make_tiny_qwen2(str(model), seed=0, num_layers=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{qwen_tokenizer_dir}/{name}", model / name)
    with open(tmp_path / "notes.jsonl", "w") as f:
        for i in range(24):
            f.write(json.dumps({"id": f"n{i}", "text": f"note {i} " + "word " * (i % 9)}) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    (tmp_path / "my-run.yaml").write_text(
        "run: run\nspec:\n  name: mine\n  model: {path: model, dtype: float32}\n"
        "  tokenizer: {path: model}\n  sources:\n    - {kind: text, paths: [notes.jsonl]}\n"
        "  packing: {mode: segmented, seq_len: 16}\n"
        "  capture: {hooks: layers.0.resid_post, dtype: float32}\n"
        "  layout: {rows_per_shard: 2, partition_rows: 4, codec: none}\n"
        "target: {kind: local, hosts: 1, batch_size: 2}\n")
    return model


def test_a_damaged_token_store_is_named_and_its_advice_finishes_the_run(
        tmp_path, monkeypatch, qwen_tokenizer_dir, capsys):
    """A token-store object is damaged after prepare: one byte changed, which its chunk's
    checksum (schemas.chunk_checksums) catches where uncompressed tokens would otherwise read
    as other tokens. In a partition not yet extracted, the workers say so in one line,
    naming the object and the commands that write the same tokens again and extract the
    rest; in a committed partition, `actx verify` says so and what to do. Followed as
    printed, the run finishes and verifies, with the tokens prepare first wrote."""

    from tests.test_bos_rule import stored_documents

    monkeypatch.chdir(tmp_path)
    model = _own_data_config(tmp_path, qwen_tokenizer_dir)
    assert cli.main(["submit", "my-run.yaml"], out=io.StringIO()) == 0
    run = str(tmp_path / "run")
    tokens = stored_documents(run)
    # Partition 1 as after a crash before its commit, one byte of its token shard changed:
    # its first token's id (an uncompressed chunk begins with it) one more.
    os.remove(os.path.join(run, *layout.commit_key(1).split("/")))
    shard = os.path.join(run, "tokens", "input_ids", "c", "1", "0")
    _change_first_byte(shard)

    out = io.StringIO()
    assert cli.main(["rerun", run], out=out) == 1
    said = out.getvalue()
    assert "the token store was damaged after prepare" in said and shard in said, said
    assert "Traceback" not in said
    # The launcher's last line too says what to run before the rerun.
    last = said.strip().splitlines()[-1]
    assert [kind for kind, _ in advice.find(last)] == ["reprepare", "rerun"], last
    code, output = follow(said, "reprepare")
    assert code == 0, output
    code, output = follow(said, "rerun")
    assert code == 0, output
    assert runstate.compute_status(run_dir.open_run(run)).complete
    assert cli.main(["verify", run], out=io.StringIO()) == 0
    assert stored_documents(run) == tokens

    # A committed partition's token rows damaged: verify names them and what to do; its
    # activations stand (they were computed before), so --repair leaves it committed.
    _change_first_byte(os.path.join(run, "tokens", "segment_ids", "c", "0", "0"))
    out = io.StringIO()
    assert cli.main(["verify", run, "--json"], out=out) == 1
    report = json.loads(out.getvalue())
    assert report["tokens_damaged"] == ["p-00000"] and report["failed"] == [], report
    out = io.StringIO()
    assert cli.main(["verify", run], out=out) == 1
    said = out.getvalue()
    assert "token store was damaged after prepare" in said and "rerun" not in said, said
    # The tokenizer's files changed since the prepare (a normalizer that folds "ﬁ" and "Ⅻ"
    # into other ids): preparing again would put other tokens under the committed
    # activations, so the advice is refused, naming why, and nothing is touched.
    tok = model / "tokenizer.json"
    before = tok.read_bytes()
    tok.write_text(json.dumps({**json.loads(before), "normalizer": {"type": "NFKC"}}))
    capsys.readouterr()
    code, _ = follow(said, "reprepare")
    output = "".join(capsys.readouterr())  # the CLI's error line, wherever it went
    assert code == 2 and "is not the one this run's tokens were made with" in output, output
    assert "normalizer differ" in output and "Traceback" not in output, output
    assert runstate.compute_status(run_dir.open_run(run)).complete
    tok.write_bytes(before)  # restored, the advice finishes the run
    _reprepare_then_verify(said, run, tokens)

    # The same advice with a damaged chunk of a committed partition and an input edited
    # since (as many tokens): the chunk, unreadable, would be written from the edited
    # input under activations computed on the first; the commit markers' token checksums
    # say so, and nothing is written. The input restored, the advice finishes the run.
    shard = os.path.join(run, "tokens", "input_ids", "c", "0", "0")
    _change_first_byte(shard)
    damaged = open(shard, "rb").read()
    notes = tmp_path / "notes.jsonl"
    original = notes.read_text()
    notes.write_text(original.replace('"note 0 ', '"note 9 ', 1))
    capsys.readouterr()
    code, _ = follow(said, "reprepare")
    output = "".join(capsys.readouterr())
    assert code == 2, output
    assert ("partition p-00000 is committed and its input_ids rows cannot be read; the inputs "
            "now make other tokens for rows 0-1 than the run's activations were computed on"
            ) in output, output
    assert open(shard, "rb").read() == damaged
    notes.write_text(original)
    _reprepare_then_verify(said, run, tokens)

    # A fault audit's two more: a committed partition's token object deleted (the advised
    # prepare read it as fill values, took them for changed inputs and exited 2), and a
    # doc table deleted (verify passed; `document` said the document never existed).
    import actx
    from actx.reader import errors as reader_errors

    doc = actx.open_run(run).document("n5")
    os.remove(shard)
    table = os.path.join(run, *layout.docs_key(doc.meta["partition"]).split("/"))
    os.remove(table)
    with pytest.raises(reader_errors.LostDataError) as lost:
        actx.open_run(run).document("n5")
    assert [kind for kind, _ in advice.find(str(lost.value))] == ["reprepare"], lost.value
    out = io.StringIO()
    assert cli.main(["verify", run], out=out) == 1
    said = out.getvalue()
    assert (f"1 committed partition(s) lost their doc table ({run}/docs: "
            f"{layout.partition_name(doc.meta['partition'])}") in said, said
    assert "partition p-00000: token rows 0-3 cannot be read" in said, said
    _reprepare_then_verify(said, run, tokens)
    again = actx.open_run(run).document("n5")
    assert again.meta == doc.meta and (again.input_ids == doc.input_ids).all()

    # A doc table cut short (verify passed; the reader's `document` raised a bare JSON
    # error): both name the damaged line and the prepare that writes it again.
    whole = open(table, "rb").read()
    open(table, "wb").write(whole[:len(whole) // 2])
    with pytest.raises(ValueError, match=r"\.jsonl:\d+: not JSON .*the doc table was "
                                         r"damaged after prepare") as damaged_table:
        actx.open_run(run).document("n5")
    assert [kind for kind, _ in advice.find(str(damaged_table.value))] == ["reprepare"]
    out = io.StringIO()
    assert cli.main(["verify", run], out=out) == 1
    said = out.getvalue()
    assert f"{table}:" in said and "the doc table was damaged after prepare" in said, said
    _reprepare_then_verify(said, run, tokens)
    assert open(table, "rb").read() == whole
    assert actx.open_run(run).document("n5").meta == doc.meta


def _reprepare_then_verify(said: str, run: str, tokens: dict) -> None:
    """Follows `said`'s prepare, then its verify, as printed: both pass, and the run holds
    `tokens` again."""
    from tests.test_bos_rule import stored_documents

    code, output = follow(said, "reprepare")
    assert code == 0, output
    code, output = follow(said, "verify")
    assert code == 0, output
    assert stored_documents(run) == tokens


def _change_first_byte(path: str) -> None:
    with open(path, "r+b") as f:
        first = f.read(1)[0]
        f.seek(0)
        f.write(bytes([first ^ 1]))


def test_a_run_that_needed_more_rejects_is_prepared_again_by_the_advice_as_printed(
        tmp_path, monkeypatch, qwen_tokenizer_dir):
    """A run whose prepare accepted rejects past the default bound (`--max-reject-fraction`
    on the submit): its token store deleted, verify's advice (`actx prepare --out RUN
    --spec RUN/run.json`, no such flag) prepares it again, accepting the same rejects, and
    the run verifies with the tokens first written; its run.json deleted, the advised
    submit of the same config does the same. Both failed before, removing manifest.json."""
    import shutil

    from tests.test_bos_rule import stored_documents

    monkeypatch.chdir(tmp_path)
    # 2 of 26 rejected: 7.7%, over the default 1%.
    _own_data_config(tmp_path, qwen_tokenizer_dir,
                     extra_lines=('{"id": "bad", "text": ', '{"id": "worse"'))
    out = io.StringIO()
    assert cli.main(["submit", "my-run.yaml"], out=out) == 2, out.getvalue()
    assert cli.main(["submit", "my-run.yaml", "--max-reject-fraction=0.077"],
                    out=io.StringIO()) == 0
    run = str(tmp_path / "run")
    tokens = stored_documents(run)

    shutil.rmtree(os.path.join(run, "tokens"))
    out = io.StringIO()
    assert cli.main(["verify", run], out=out) == 1
    said = out.getvalue()
    # The reader names the same command (it raised a bare "cannot be opened" before).
    import actx

    with pytest.raises(FileNotFoundError) as raised:
        actx.open_run(run).document(0)
    assert [kind for kind, _ in advice.find(str(raised.value))] == ["reprepare"], raised.value
    assert advice.find(str(raised.value))[0] in advice.find(said), (raised.value, said)
    code, output = follow(said, "reprepare")
    assert code == 0, output
    assert cli.main(["verify", run], out=io.StringIO()) == 0
    assert stored_documents(run) == tokens
    attempt = os.path.join(run, "prepare", "attempt.json")
    with open(attempt, "rb") as f:
        first_attempt = f.read()

    # The advised prepare stopped on the way (after its pipeline, before its manifest):
    # the manifest that recorded the rejects is cleared, and the same advice, followed
    # again, still accepts them; the run ends as byte-identical as before.
    from actx.pipeline import write_store

    def stopped(_run):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(write_store, "make_durable", stopped)
        code, output = follow(said, "reprepare")
    assert code == 130, (code, output)  # as Ctrl-C ends a prepare
    assert not os.path.exists(os.path.join(run, "manifest.json"))
    code, output = follow(said, "reprepare")
    assert code == 0, output
    assert cli.main(["verify", run], out=io.StringIO()) == 0
    assert stored_documents(run) == tokens
    with open(attempt, "rb") as f:
        assert f.read() == first_attempt

    # Stopped again, and then the inputs changed (a reject line edited: the same tokens,
    # the same fraction): what the attempt carried is not taken for these inputs, which
    # are held to the bound asked, and the command the refusal prints finishes the run.
    with monkeypatch.context() as patched:
        patched.setattr(write_store, "make_durable", stopped)
        assert follow(said, "reprepare")[0] == 130
    notes = tmp_path / "notes.jsonl"
    notes.write_text(notes.read_text().replace('"text": \n', '"text": 1\n'))
    printed = io.StringIO()  # `actx prepare` prints to standard output
    with contextlib.redirect_stdout(printed):
        code, output = follow(said, "reprepare")
    output += printed.getvalue()
    assert code == 2 and "more than --max-reject-fraction=0.01" in output, output
    accept = next(line.strip() for line in output.splitlines()
                  if "--max-reject-fraction=0.077" in line)
    out = io.StringIO()
    assert cli.main(shlex.split(accept)[1:], out=out) == 0, out.getvalue()
    assert cli.main(["verify", run], out=io.StringIO()) == 0
    assert stored_documents(run) == tokens

    os.remove(os.path.join(run, "run.json"))  # status says to submit the config again
    out = io.StringIO()
    assert cli.main(["submit", "my-run.yaml"], out=out) == 0, out.getvalue()
    assert cli.main(["verify", run], out=io.StringIO()) == 0
    assert stored_documents(run) == tokens


@pytest.mark.parametrize("array", ["input_ids", "positions"])
def test_a_damaged_token_array_metadata_is_mended_by_the_advice_as_printed(
        tmp_path, monkeypatch, qwen_tokenizer_dir, array):
    """A complete run whose `tokens/<array>/zarr.json` is cut to half: verify names the
    prepare that writes the token store again, and that prepare, followed as printed,
    writes the metadata again (it failed on tensorstore's DATA_LOSS, removing
    manifest.json, so every later command advised the same failing prepare); the run
    verifies with the tokens first written."""
    from tests.test_bos_rule import stored_documents

    monkeypatch.chdir(tmp_path)
    _own_data_config(tmp_path, qwen_tokenizer_dir)
    assert cli.main(["submit", "my-run.yaml"], out=io.StringIO()) == 0
    run = str(tmp_path / "run")
    tokens = stored_documents(run)
    metadata = os.path.join(run, "tokens", array, "zarr.json")
    with open(metadata, "rb") as f:
        first = f.read()
    os.truncate(metadata, len(first) // 2)
    out = io.StringIO()
    assert cli.main(["verify", run], out=out) == 1
    code, output = follow(out.getvalue(), "reprepare")
    assert code == 0, output
    with open(metadata, "rb") as f:
        assert f.read() == first
    assert cli.main(["verify", run], out=io.StringIO()) == 0
    assert stored_documents(run) == tokens


@pytest.mark.parametrize("damage", ["metadata", "removed"])
def test_a_token_store_damaged_under_a_partial_run_is_named_with_its_prepare(
        tmp_path, monkeypatch, qwen_tokenizer_dir, damage):
    """A partition left to extract, and the token store damaged after prepare (an array's
    zarr.json cut to half, or tokens/ removed): the worker names the prepare that writes
    it again (it printed tensorstore's DATA_LOSS, or called the store an older prepare's
    and advised a new run directory, and the launcher a rerun that failed the same way);
    followed as printed, that prepare and then the rerun finish the run with the tokens
    and activations first written."""
    import shutil

    from tests.test_bos_rule import stored_documents

    monkeypatch.chdir(tmp_path)
    _own_data_config(tmp_path, qwen_tokenizer_dir)
    assert cli.main(["submit", "my-run.yaml"], out=io.StringIO()) == 0
    run = str(tmp_path / "run")
    tokens, before = stored_documents(run), worker_procs.stored_objects(run)
    os.remove(os.path.join(run, "commits", "p-00001.json"))  # left to extract
    if damage == "metadata":
        metadata = os.path.join(run, "tokens", "input_ids", "zarr.json")
        os.truncate(metadata, os.path.getsize(metadata) // 2)
    else:
        shutil.rmtree(os.path.join(run, "tokens"))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli.main(["rerun", run], out=out) != 0
    said = out.getvalue() + err.getvalue()
    assert "the token store was damaged after prepare" in said, said
    code, output = follow(said, "reprepare")
    assert code == 0, output
    code, output = follow(said, "rerun")
    assert code == 0, output
    assert cli.main(["verify", run], out=io.StringIO()) == 0
    assert stored_documents(run) == tokens
    assert worker_procs.stored_objects(run) == before


def test_values_past_float16s_range_are_refused_not_stored_as_infinities(
        tmp_path, monkeypatch, qwen_tokenizer_dir):
    """A model whose residual stream goes past float16's range (±65,504; its embeddings
    scaled up, as some models' massive activations do), captured in float16: the cast made
    them infinities, stored and committed with exit 0 (only a later verify saw them, and
    its repair and rerun wrote them again). The worker now refuses the block before any
    write, names the hook and what to store instead, and commits nothing."""
    from safetensors.torch import load_file, save_file

    monkeypatch.chdir(tmp_path)
    model = _own_data_config(tmp_path, qwen_tokenizer_dir)
    weights = load_file(model / "model.safetensors")
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] * 5e6
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    config = tmp_path / "my-run.yaml"
    config.write_text(config.read_text().replace(
        "hooks: layers.0.resid_post, dtype: float32", "hooks: layers.0.resid_post, dtype: float16"))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(["submit", "my-run.yaml"], out=out)
    said = out.getvalue() + err.getvalue()
    assert code != 0, said
    assert "layers.0.resid_post" in said and "not finite as float16" in said, said
    assert "capture.dtype" in said, said
    # The launcher's last word advises no rerun, which would fail the same way (the
    # phase's "rerun after a fix" stands).
    last = [line for line in said.splitlines() if line.startswith("extract: ")][-1]
    assert "capture.dtype bfloat16" in last and not advice.find(last), last
    assert not os.listdir(tmp_path / "run" / "commits") if (
        tmp_path / "run" / "commits").exists() else True


def test_a_hooks_damaged_metadata_under_a_partial_run_is_named_with_its_repair(
        tmp_path, monkeypatch, qwen_tokenizer_dir):
    """A partition left to extract, and a hook's `zarr.json` overwritten with garbage: the
    worker names the repair (it printed tensorstore's DATA_LOSS, and the launcher advised
    a rerun that failed the same way); followed as printed, the repair and then the rerun
    finish the run with the activations first written."""
    monkeypatch.chdir(tmp_path)
    _own_data_config(tmp_path, qwen_tokenizer_dir)
    assert cli.main(["submit", "my-run.yaml"], out=io.StringIO()) == 0
    run = str(tmp_path / "run")
    before = worker_procs.stored_objects(run)
    os.remove(os.path.join(run, "commits", "p-00001.json"))  # left to extract
    with open(os.path.join(run, "activations", "layers.0.resid_post", "zarr.json"), "wb") as f:
        f.write(b"\x00garbage\xff" * 8)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli.main(["rerun", run], out=out) != 0
    said = out.getvalue() + err.getvalue()
    assert "damaged (not an array's metadata)" in said, said
    follow(said, "repair")
    code, output = follow(said, "rerun")
    assert code == 0, output
    assert cli.main(["verify", run], out=io.StringIO()) == 0
    assert worker_procs.stored_objects(run) == before
