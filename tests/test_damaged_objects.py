"""A damaged JSON object in a run directory (a commit marker, a heartbeat) through the real
CLI entry point: one line naming the object and what to do, never a traceback; verify
fails the partition and `--repair` turns it back into pending; status --check does not
call a run finished while the latest verify failed partitions it has committed; a heartbeat (advisory) that cannot be read
shows its host as unknown and status and rerun carry on."""

from __future__ import annotations

import io
import json
import os

import pytest

from actx.deploy import cli
from actx.schemas import advice
from actx.schemas import layout
from tests import reader_fixtures, status_runs


def _cli(capsys, *argv) -> tuple[int, str, str]:
    out = io.StringIO()
    code = cli.main(list(argv), out=out)
    captured = capsys.readouterr()
    return code, out.getvalue() + captured.out, captured.err


def _damage(path: str) -> None:
    os.truncate(path, 10)  # as `truncate -s 10`


@pytest.fixture
def committed_run(tmp_path) -> str:
    """A run of 6 partitions, every one committed (real commit markers and arrays)."""
    return reader_fixtures.build_run(str(tmp_path / "run"), num_partitions=6,
                                     committed=tuple(range(6))).uri


def test_damaged_commit_marker(committed_run, capsys):
    marker = os.path.join(committed_run, *layout.commit_key(3).split("/"))
    code, out, err = _cli(capsys, "verify", committed_run)
    assert code == 0, out + err
    _damage(marker)

    code, out, err = _cli(capsys, "verify", committed_run)
    assert code == 1, out + err
    assert "Traceback" not in out + err
    [line] = [l for l in out.splitlines() if "p-00003" in l]
    assert marker in line and "not valid JSON" in line and "cannot be read" in line
    assert f"`{advice.repair(committed_run)}`" in out
    assert json.loads(_cli(capsys, "verify", committed_run, "--json")[1])["failed"] == [
        "p-00003"]

    # status reads markers' names only; once verify has failed the partition, status
    # --check does not call the run finished, and its one line says what to do.
    code, out, err = _cli(capsys, "status", committed_run, "--check")
    assert code == 1, out + err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert "failed the latest `actx verify`" in err
    assert f"`{advice.repair(committed_run)}`" in err
    assert f"`{advice.rerun(committed_run)}`" in err

    # --repair: the partition is pending again (what `actx rerun` extracts), the marker's
    # bytes kept in the repair record.
    code, out, err = _cli(capsys, "verify", committed_run, "--repair")
    assert code == 1 and "Traceback" not in out + err, out + err
    assert "REPAIRED: 1 partition(s)" in out and "p-00003" in out
    assert not os.path.exists(marker)
    repairs = os.path.join(committed_run, *layout.VERIFY_REPAIRS_PREFIX.split("/"))
    [record] = os.listdir(repairs)
    with open(os.path.join(repairs, record)) as f:
        assert "unreadable" in json.load(f)["markers"]["p-00003"]
    code, out, err = _cli(capsys, "status", committed_run, "--json")
    assert code == 0 and json.loads(out)["counts"]["committed"] == 5, out + err
    code, out, err = _cli(capsys, "verify", committed_run, "--committed-only")
    assert code == 0, out + err


def test_a_marker_that_is_json_but_no_marker(committed_run, capsys):
    marker = os.path.join(committed_run, *layout.commit_key(1).split("/"))
    with open(marker, "w") as f:
        f.write('{"partition": 1}\n')
    code, out, err = _cli(capsys, "verify", committed_run)
    assert code == 1 and "Traceback" not in out + err, out + err
    assert any("p-00001" in l and marker in l for l in out.splitlines()), out


@pytest.fixture
def finished_synthetic(tmp_path, monkeypatch) -> str:
    """A finished run of 4 partitions and 2 hosts (status_runs: markers and heartbeats, no
    data); its model path (relative) names an existing directory, so a rerun gets as far
    as the run's state."""
    monkeypatch.chdir(tmp_path)
    os.mkdir(tmp_path / "synthetic-model")
    return status_runs.write_local(str(tmp_path / "synthetic"), n_partitions=4, n_hosts=2,
                                   committed=4, dead_hosts=0)


@pytest.mark.parametrize("command", ["status", "rerun"])
def test_damaged_heartbeat(finished_synthetic, command, capsys):
    beat = os.path.join(finished_synthetic, *layout.heartbeat_key("host-000").split("/"))
    _damage(beat)
    code, out, err = _cli(capsys, command, finished_synthetic)
    assert code == 0, out + err
    assert "Traceback" not in out + err
    if command == "status":
        [line] = [l for l in out.splitlines() if beat in l]
        assert "host unknown" in line and "not valid JSON" in line
        assert "host-001" in out  # the readable host is shown as before
    else:
        assert "nothing to do" in out + err


def test_damaged_heartbeat_in_status_json_and_check(finished_synthetic, capsys):
    beat = os.path.join(finished_synthetic, *layout.heartbeat_key("host-001").split("/"))
    with open(beat, "w") as f:
        f.write('{"host": 7}\n')  # JSON, but no heartbeat
    code, out, err = _cli(capsys, "status", finished_synthetic, "--json")
    assert code == 0 and "Traceback" not in err, out + err
    obj = json.loads(out)
    [said] = obj["unreadable_heartbeats"]
    assert beat in said
    assert [h["host"] for h in obj["hosts"]] == ["host-000"]
    code, out, err = _cli(capsys, "status", finished_synthetic, "--check")
    assert code == 0, out + err


def test_status_check_is_not_complete_while_the_latest_verify_failed(committed_run, capsys):
    """A lost shard: verify fails its partition; status --check (a script's gate: exit 0
    means the data is complete) says so until the advised repair and rerun, whose commands
    it names."""
    shard_dir = os.path.join(committed_run, "activations")
    hook = sorted(d for d in os.listdir(shard_dir) if not d.endswith(".json"))[0]
    chunks = os.path.join(shard_dir, hook, "c")
    first = sorted(os.listdir(chunks), key=int)[0]
    import shutil
    shutil.rmtree(os.path.join(chunks, first))
    assert _cli(capsys, "status", committed_run, "--check")[0] == 0  # names only: complete
    assert _cli(capsys, "verify", committed_run)[0] == 1
    code, out, err = _cli(capsys, "status", committed_run, "--check")
    assert code == 1 and "failed the latest `actx verify`" in err, out + err


def test_status_check_is_not_complete_while_the_latest_verify_failed_on_the_token_store(
        committed_run, capsys):
    """Every marker there, but a doc table lost: the latest verify failed on the token
    store, which no partition's repair mends, and status --check exits 1 (it said 0:
    complete, by the markers' names) until a verify passes."""
    os.remove(os.path.join(committed_run, *layout.docs_key(3).split("/")))
    assert _cli(capsys, "verify", committed_run)[0] == 1
    code, out, err = _cli(capsys, "status", committed_run, "--check")
    assert code == 1 and "the latest `actx verify` failed" in err, out + err
