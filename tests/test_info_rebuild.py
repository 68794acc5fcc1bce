"""A damaged or deleted activations/actx.json (the run's record of what its activations
are) no longer stops every command: status, the reader and a worker say
what is wrong and name `actx verify RUN --repair`, which rebuilds the record from
run.json, the commit markers and the arrays' metadata (deploy.info_rebuild) and keeps
every partition whose data checks out. Followed as printed, the run ends verified with the
bytes of an undamaged run. Real worker processes on tiny random checkpoints: a dense Qwen2
stored in float32, and an OLMoE stored as float8 (scale arrays beside each hook) with its
int32 expert ids (a hook of its own dtype)."""

from __future__ import annotations

import io
import json
import os
import re
import shlex

import pytest

from actx import reader
from actx.deploy import cli
from actx.schemas import activations_info as info_lib
from actx.schemas import commit, config, layout, store
from tests import hf_models, token_runs, worker_procs

COMMAND = re.compile(r"`(actx [^`]*)`")
RUNS = {
    "dense": ("qwen2", "layers.*.resid_post", "float32"),
    "moe-float8": ("olmoe", "layers.0.resid_post,layers.1.experts", "float8_e4m3"),
}


def _cli(*argv) -> tuple[int, str]:
    out = io.StringIO()
    return cli.main([str(a) for a in argv], out=out), out.getvalue()


def _follow(command: str) -> tuple[int, str]:
    """A printed `actx ...` command, run as printed."""
    return _cli(*shlex.split(command)[1:])


def _arrays(run: str) -> dict[str, bytes]:
    """Every stored activation object's bytes (the arrays' metadata and the record aside)."""
    root = os.path.join(run, "activations")
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(root) for f in files
            if f not in ("zarr.json", "actx.json")}


def _extracted(tmp_path, kind: str, run: str | None = None) -> tuple[str, dict]:
    arch, hooks, dtype = RUNS[kind]
    model = hf_models.make_tiny_checkpoint(tmp_path / "model", arch, num_hidden_layers=2)
    run = run or str(tmp_path / "run")
    token_runs.write_token_run(run, str(model), n_rows=24, seq_len=16, partition_rows=8,
                               rows_per_shard=4, hooks=hooks, dtype=dtype)  # 3 partitions
    code, out = _cli("rerun", run, "--hosts", "1", "--batch-size", "4")
    assert code == 0, out
    return run, store.open_store(run).read_json(layout.ACTIVATIONS_INFO_KEY)


def _changes(run: str) -> list[dict]:
    s = store.open_store(run)
    return [s.read_json(k) for k in sorted(s.list(layout.CHANGES_PREFIX))]


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_a_truncated_record_is_rebuilt_and_the_data_kept(tmp_path, kind):
    run, original = _extracted(tmp_path, kind)
    before = _arrays(run)
    markers = sorted(os.listdir(os.path.join(run, "commits")))
    record = os.path.join(run, layout.ACTIVATIONS_INFO_KEY)
    with open(record, "r+") as f:  # cut short, as a write that died half way leaves it
        f.truncate(len(f.read()) // 2)

    # Each command says what is wrong and what rebuilds it.
    repair = f"actx verify {run} --repair"
    code, out = _cli("status", run)
    assert code == 0 and "phase:      failed: " in out and "not valid JSON" in out, out
    assert COMMAND.findall(out.splitlines()[1]) == [repair, f"actx rerun {run}"], out
    with pytest.raises(Exception, match=re.escape(f"`{repair}` rebuilds it")):
        reader.open_run(run).hooks
    code, out = _cli("verify", run)
    assert code == 1 and "rebuilt for this check" in out, out
    assert "OK: every" not in out and "REPAIRED" not in out
    assert COMMAND.findall(out.splitlines()[-1]) == [repair], out

    # Followed as printed: the record is rebuilt, no partition is extracted again.
    code, out = _follow(repair)
    assert "REBUILT: " in out and "REPAIRED" not in out, out
    assert COMMAND.findall(out.splitlines()[-1]) == [f"actx verify {run}"], out
    code, out = _follow(f"actx verify {run}")
    assert code == 0 and "OK: every committed block matches its checksum" in out, out
    assert sorted(os.listdir(os.path.join(run, "commits"))) == markers
    assert _arrays(run) == before

    # The record holds what the first worker wrote: the checkpoint digest and numerics
    # too, from the markers.
    with open(record) as f:
        rebuilt = json.load(f)
    assert rebuilt == original and original["model_digest"] and original["numerics"]
    change = _changes(run)[-1]
    assert change["kind"] == "activations-info" and change["unknown"] == []
    assert "not valid JSON" in change["why"]
    # The damaged bytes are kept with the repair.
    s = store.open_store(run)
    [kept] = [s.read_json(k) for k in s.list(layout.VERIFY_REPAIRS_PREFIX)]
    assert "unreadable" in kept["metadata"][layout.ACTIVATIONS_INFO_KEY]
    opened = reader.open_run(run)
    assert sorted(opened.hooks) == sorted(original["hooks"])


def test_a_damaged_record_and_damaged_data_rerun_to_an_undamaged_run(tmp_path):
    """Beside the damaged record, one object of p-00002 is damaged: `--repair` rebuilds
    the record and turns p-00002 back into pending, and the rerun's worker, which cannot
    compare its checkpoint digest and numerics with a rebuilt record's, extracts it: the
    bytes are an undamaged run's."""
    run, _ = _extracted(tmp_path, "dense")
    before = _arrays(run)
    with open(os.path.join(run, layout.ACTIVATIONS_INFO_KEY), "w") as f:
        f.write('{"dtype": "float32"}\n')  # JSON, but not a record: a field is missing
    victim = os.path.join(run, "activations", "layers.0.resid_post", "c", "4", "0", "0")
    with open(victim, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))

    # A rerun's worker refuses the damaged record, naming what rebuilds it.
    s = store.open_store(run)
    s.delete(layout.commit_key(1))
    code, out = _cli("rerun", run, "--hosts", "1", "--batch-size", "4")
    assert code != 0 and f"actx verify {run} --repair" in out, out
    assert not s.exists(layout.commit_key(1))

    code, out = _cli("verify", run)
    assert code == 1 and "fingerprint: required key is missing" in out, out
    assert "partition p-00002, array layers.0.resid_post: block 0 (rows 16-19)" in out, out
    advice = COMMAND.findall(out.splitlines()[-1])
    assert advice == [f"actx verify {run} --repair", f"actx rerun {run}"], out
    code, out = _follow(advice[0])
    assert "REBUILT: " in out and "REPAIRED: 1 partition(s)" in out and "p-00002" in out, out
    code, out = _follow(advice[1])
    assert code == 0, out
    code, out = _cli("verify", run)
    assert code == 0 and "OK: every committed block matches its checksum" in out, out
    assert commit.committed_partitions(s, 3) == {0, 1, 2}
    assert _arrays(run) == before


def test_a_deleted_record_is_rebuilt_where_the_arrays_stand(tmp_path):
    """The old advice said "rewrite it or delete it": a record deleted by hand, with every
    array in place, is rebuilt as a damaged one is, and nothing is extracted again."""
    run, original = _extracted(tmp_path, "dense")
    markers = sorted(os.listdir(os.path.join(run, "commits")))
    os.remove(os.path.join(run, layout.ACTIVATIONS_INFO_KEY))
    code, out = _cli("verify", run)
    assert code == 1 and "actx.json: missing; rebuilt for this check" in out, out
    code, out = _cli("verify", run, "--repair")
    assert "REBUILT: " in out and "REPAIRED" not in out, out
    assert _cli("verify", run)[0] == 0
    assert sorted(os.listdir(os.path.join(run, "commits"))) == markers
    assert info_lib.read_info(store.open_store(run)) == config.from_dict(
        info_lib.ActivationsInfo, original, "")


def test_a_record_deleted_from_a_bucket_is_rebuilt_there(tmp_path, gcs_bucket):
    """The same on gs:// (the GCS emulator): the rebuild reads the markers and the arrays'
    metadata through the bucket, and writes the record there."""
    run, original = _extracted(tmp_path, "dense", f"{gcs_bucket}/runs/rebuilt")
    s = store.open_store(run)
    markers = sorted(s.list(layout.COMMITS_PREFIX))
    s.delete(layout.ACTIVATIONS_INFO_KEY)
    code, out = _cli("verify", run, "--repair")
    assert code == 1 and "REBUILT: " in out and "REPAIRED" not in out, out
    code, out = _cli("verify", run)
    assert code == 0 and "OK: every committed block matches its checksum" in out, out
    assert sorted(s.list(layout.COMMITS_PREFIX)) == markers
    assert s.read_json(layout.ACTIVATIONS_INFO_KEY) == original


def test_a_newer_actx_record_is_not_called_damaged(tmp_path):
    """A field this actx does not know is a newer actx's record, not damage: said as it
    is, never rebuilt over."""
    s = store.open_store(str(tmp_path))
    s.write_json(layout.ACTIVATIONS_INFO_KEY, {"fingerprint": "f", "dtype": "bfloat16",
                                               "hooks": {}, "sharding": "new"})
    with pytest.raises(config.ConfigError, match="sharding: unknown key") as raised:
        info_lib.read_info(s)
    assert not isinstance(raised.value, info_lib.DamagedInfoError)
    s.write(layout.ACTIVATIONS_INFO_KEY, b'{"fingerprint": "f", "dt')
    with pytest.raises(info_lib.DamagedInfoError, match="not valid JSON"):
        info_lib.read_info(s)


def test_a_default_extraction_without_its_record_is_still_one_of_the_run(tmp_path):
    """Beside named extractions, the default one counts as in use by its record; deleted by
    hand, its markers still say so, so `actx verify --repair` (which verifies the run's
    extractions) reaches it and rebuilds its record."""
    from actx.schemas import extraction_store

    s = store.open_store(str(tmp_path))
    s.write_json(f"{layout.EXTRACTION_NAMES_PREFIX}chat.json", {"name": "chat"})
    assert extraction_store.names(s) == ["chat"]  # a run of named models only
    s.write_json(layout.commit_key(0), {"partition": 0})
    assert extraction_store.names(s) == ["", "chat"]


def _marker_files(run: str) -> list[str]:
    return sorted(os.listdir(os.path.join(run, "commits")))


def _edit_markers(run: str, edit) -> None:
    for name in _marker_files(run):
        path = os.path.join(run, "commits", name)
        with open(path) as f:
            data = json.load(f)
        edit(data)
        with open(path, "w") as f:
            json.dump(data, f)


def test_markers_of_an_earlier_actx_leave_the_digest_unknown(tmp_path):
    """Markers an earlier actx wrote record no checkpoint digest or numerics: the rebuilt
    record leaves them null, and verify and the change record say what stayed unknown."""
    run, original = _extracted(tmp_path, "dense")
    _edit_markers(run, lambda m: [m.pop("model_digest"), m.pop("numerics")])
    os.remove(os.path.join(run, layout.ACTIVATIONS_INFO_KEY))
    code, out = _cli("verify", run, "--repair")
    assert code == 1 and "REBUILT: " in out and "REPAIRED" not in out, out
    assert "model_digest and numerics of the first attempt: not kept" in out, out
    assert _cli("verify", run)[0] == 0
    assert store.open_store(run).read_json(layout.ACTIVATIONS_INFO_KEY) == {
        **original, "model_digest": None, "numerics": None}
    assert _changes(run)[-1]["unknown"] == ["model_digest", "numerics"]


def test_a_run_an_earlier_actx_began_takes_the_digest_from_a_later_marker(tmp_path,
                                                                          monkeypatch):
    """The first partitions' markers an earlier actx's (no digest), a later one this
    release's: the rebuilt record takes the digest and numerics from the later one."""
    from actx.deploy import info_rebuild

    run, original = _extracted(tmp_path, "dense")
    s = store.open_store(run)
    # The rebuild reads the first MARKERS_TRIED (8) markers for the arrays: with 2, p-00000
    # and p-00001 stand for an earlier actx's markers, p-00002 for this release's.
    monkeypatch.setattr(info_rebuild, "MARKERS_TRIED", 2)
    for p in (0, 1):
        path = os.path.join(run, layout.commit_key(p))
        with open(path) as f:
            data = json.load(f)
        data.pop("model_digest"), data.pop("numerics")
        with open(path, "w") as f:
            json.dump(data, f)
    info, why = info_rebuild.rebuild(s, reader.open_run(run).spec,
                                     sorted(commit.committed_partitions(s, 3)))
    assert why == "" and config.to_dict(info)["model_digest"] == original["model_digest"]
    assert config.to_dict(info)["numerics"] == original["numerics"]


def test_a_deleted_record_never_lets_other_weights_into_the_run(tmp_path):
    """The record deleted, a partition pending and the checkpoint's weights changed: the
    rerun's worker does not write a record afresh (it would vouch for the committed
    partitions whatever computed them) but names what rebuilds it; the rebuilt record
    holds the first attempt's checkpoint digest (from the markers), so the rerun with
    other weights is refused, and with the original weights back the run finishes as an
    undamaged run's bytes. Before, the rerun extracted p-00001 with the other weights."""
    import shutil

    run, original = _extracted(tmp_path, "dense")
    before = _arrays(run)
    model = str(tmp_path / "model")
    shutil.copytree(model, tmp_path / "model-original")
    s = store.open_store(run)
    s.delete(layout.ACTIVATIONS_INFO_KEY)
    s.delete(layout.commit_key(1))
    hf_models.make_tiny_checkpoint(model, "qwen2", seed=1, num_hidden_layers=2)

    code, out = _cli("rerun", run, "--hosts", "1", "--batch-size", "4")
    assert code != 0 and f"`actx verify {run} --repair`" in out, out
    assert not s.exists(layout.ACTIVATIONS_INFO_KEY) and not s.exists(layout.commit_key(1))
    # A worker started on its own (as a Slurm task or a pod's host runs it) refuses too.
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "4"], devices=1)
    assert code != 0 and "actx.json: missing, but partitions are committed" in out, out
    assert f"`actx verify {run} --repair`" in out, out
    assert not s.exists(layout.ACTIVATIONS_INFO_KEY) and not s.exists(layout.commit_key(1))

    code, out = _follow(f"actx verify {run} --repair")
    assert "REBUILT: " in out, out
    assert s.read_json(layout.ACTIVATIONS_INFO_KEY) == original
    code, out = _cli("rerun", run, "--hosts", "1", "--batch-size", "4")
    assert code != 0 and "changed since this run's first attempt" in out, out
    assert not s.exists(layout.commit_key(1))

    shutil.rmtree(model)
    shutil.copytree(tmp_path / "model-original", model)
    code, out = _cli("rerun", run, "--hosts", "1", "--batch-size", "4")
    assert code == 0, out
    code, out = _cli("verify", run)
    assert code == 0 and "OK: every committed block matches its checksum" in out, out
    assert _arrays(run) == before


def test_verify_fails_a_partition_another_checkpoint_computed(tmp_path):
    """A marker names the checkpoint digest of the attempt that computed its partition:
    one that differs from the record's (the weights changed between attempts; a worker
    refuses that by the record, so the marker is edited here) fails verify whatever its
    checksums say; followed as printed, the advice extracts it again with the run's
    weights."""
    run, original = _extracted(tmp_path, "dense")
    before = _arrays(run)
    path = os.path.join(run, layout.commit_key(1))
    with open(path) as f:
        marker = json.load(f)
    assert marker["model_digest"] == original["model_digest"]
    assert marker["numerics"] == original["numerics"]
    with open(path, "w") as f:
        json.dump({**marker, "model_digest": "0badf00d"}, f)

    code, out = _cli("verify", run)
    assert code == 1, out
    assert (f"partition p-00001: computed by checkpoint digest 0badf00d, but the run's "
            f"activations are of {original['model_digest']}") in out, out
    assert "p-00000:" not in out and "p-00002:" not in out, out
    advice = COMMAND.findall(out.splitlines()[-1])
    assert advice == [f"actx verify {run} --repair", f"actx rerun {run}"], out
    code, out = _follow(advice[0])
    assert "REPAIRED: 1 partition(s)" in out and "p-00001" in out, out
    assert _follow(advice[1])[0] == 0
    code, out = _cli("verify", run)
    assert code == 0 and "OK: every committed block matches its checksum" in out, out
    with open(path) as f:
        assert json.load(f)["model_digest"] == original["model_digest"]
    assert _arrays(run) == before
