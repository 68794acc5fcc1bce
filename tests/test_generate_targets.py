"""A generating run (spec.generate) everywhere the workers run: Beam extraction (the local
target's `extract: beam`, Dataflow's) passes the pre-flight (tests/test_beam_generate.py
generates through it); so do replicas of several hosts (a multi-host TPU slice, local
hosts_per_replica > 1: they generate in lockstep, tests/test_generate_multihost.py).
Then `actx verify --reference` on a real generating run (real Beam prepare, a real worker
process, a tiny Qwen2 with the real Qwen vocabulary): HF transformers recomputes each
sample on its prompt + generated ids, and a stored value changed at a generated position,
or a nonzero at a position the sample never reached, is caught naming the document."""

from __future__ import annotations

import io
import json
import os
import shutil

import numpy as np
import pytest

from actx.deploy import cli
from actx.deploy import config as deploy_config
from actx.deploy import preflight, targets
from actx.schemas import commit, layout, reference_verification, runspec, store, ts_context, uri
from tests import generate_runs, token_runs

HOOKS, MAX_NEW = generate_runs.HOOKS, 16
# ',' ends the list prompt's sample early (tests.generate_runs)
PROMPTS = [generate_runs.PROMPTS[i] for i in (0, 4, 2)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return generate_runs.tiny_qwen2(tmp_path_factory.mktemp("m") / "qwen2")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    return generate_runs.write_prompts(tmp_path_factory.mktemp("in") / "prompts.jsonl",
                                       PROMPTS)


def _spec_dict(model: str, tokenizer: str, prompts: str) -> dict:
    # 16-token rows and partitions of 2 rows: samples cross rows and partitions.
    return generate_runs.spec_dict(model, tokenizer, prompts, seq_len=16, max_context=64,
                                   rows_per_shard=1, partition_rows=2,
                                   max_new_tokens=MAX_NEW, stop_token_ids=[generate_runs.STOP])


@pytest.fixture(scope="module")
def spec(model, qwen_tokenizer_dir, prompts_file) -> runspec.RunSpec:
    return runspec.RunSpec.from_dict(_spec_dict(model, qwen_tokenizer_dir, prompts_file))


@pytest.fixture(scope="module")
def generated(spec, tmp_path_factory) -> str:
    """A generating run: real Beam prepare, then a real worker process."""
    run = str(tmp_path_factory.mktemp("gen") / "run")
    assert len(generate_runs.generated_run(run, spec, batch_size=2).partitions) > 1
    return run


def _cli(*argv) -> tuple[int, str]:
    out = io.StringIO()
    return cli.main([str(a) for a in argv], out=out), out.getvalue()


def _target(**fields) -> targets.Target:
    tpu = fields.pop("tpu", {})
    return targets.for_config(deploy_config.TargetConfig(
        tpu=deploy_config.TpuConfig(**tpu), **fields))


def _generate_lines(problems: list[str]) -> list[str]:
    return [p for p in problems if p.startswith("spec.generate:")]


# -- 1. Beam extraction ------------------------------------------------------------------
def test_beam_extraction_of_a_generating_run_passes_the_pre_flight(spec, tmp_path):
    """The Beam transform generates (tests/test_beam_generate.py): nothing refuses it."""
    for target in (_target(kind="local", extract="beam"),
                   _target(kind="dataflow", extract="beam")):
        found, _ = preflight.problems(spec, str(tmp_path / "run"), target, dry_run=True)
        assert not _generate_lines(found), found


# -- 2. replicas of several hosts ----------------------------------------------------------
def test_replicas_of_several_hosts_pass_the_pre_flight(spec, tmp_path):
    """A multi-host replica generates in lockstep (tests/test_generate_multihost.py,
    test_generate_tpu_vm.py): no target refuses it, nor one host per replica."""
    run = str(tmp_path / "run")
    for target in (_target(kind="tpu-vm", tpu={"accelerator_type": "v4-32"}),  # 4 hosts
                   _target(kind="tpu-vm", tpu={"accelerator_type": "v4-8"}),
                   _target(kind="local", hosts=4, hosts_per_replica=2, batch_size=2),
                   _target(kind="local", hosts=4, hosts_per_replica=1)):
        assert target.spec_problems(spec) == []
        assert not _generate_lines(preflight.problems(spec, run, target, dry_run=True)[0])


def test_rerun_of_a_complete_run_on_several_hosts_per_replica_has_nothing_to_do(generated,
                                                                                capsys):
    for per_replica in ("2", "1"):
        code, out = _cli("rerun", generated, "--target", "local", "--hosts", "2",
                         "--hosts-per-replica", per_replica, "--batch-size", "2")
        assert code == 0 and "nothing to do" in out, out + capsys.readouterr().err


# -- 3. verify --reference -------------------------------------------------------------------
def _samples(run: str) -> dict[str, dict]:
    """doc_id -> its rows, cols (document order), generated ids and doc-table entry."""
    doc_index = token_runs.read_tokens(run, "doc_index")
    positions = token_runs.read_tokens(run, "positions")
    generated_ids = token_runs.read_activation(run, layout.GENERATED_IDS)[..., 0]
    s = store.open_store(run)
    out = {}
    for key in s.list("docs/"):
        for line in s.read(key).decode().splitlines():
            doc = json.loads(line)
            r, c = np.nonzero(doc_index == doc["doc_index"])
            order = np.argsort(positions[r, c])
            r, c = r[order], c[order]
            out[doc["doc_id"]] = {"rows": r, "cols": c, "ids": generated_ids[r, c], "doc": doc}
    return out


def test_verify_reference_recomputes_prompt_and_generated_tokens(generated):
    samples = _samples(generated)
    assert len(samples) == len(PROMPTS)
    unused = {d: int((s["ids"] == layout.GENERATED_UNUSED).sum()) for d, s in samples.items()}
    assert any(unused.values()) and not all(unused.values())  # one stopped early
    code, out = _cli("verify", generated, "--reference", "--sample", "10")
    assert code == 0, out
    assert "OK: every stored value of the sample equals the model's own" in out
    record = reference_verification.read_record(store.open_store(generated))
    assert record.ok and record.tolerance == 1e-4 and set(record.hooks) == set(HOOKS.split(","))
    assert 0 < max(record.hooks.values()) < 1e-4
    # Every sample, each compared over its prompt and what it generated, never its unused room
    compared = {d.what.split(" ")[1]: d.tokens for d in record.documents}
    assert compared == {d: len(s["ids"]) - unused[d] for d, s in samples.items()}
    for d, s in samples.items():
        prompt = s["doc"]["prompt_tokens"]
        assert len(s["ids"]) == prompt + MAX_NEW
        assert f"{prompt} prompt + {MAX_NEW - unused[d]} generated; {unused[d]} unreached" in out


def test_plain_verify_reads_a_block_of_unreached_room_as_the_zeros_it_is(generated):
    """The worker writes zeros where a sample did not reach; a block of nothing else is
    kept by the store as no object at all (zarr's fill value), which is no lost write."""
    generated_ids = token_runs.read_activation(generated, layout.GENERATED_IDS)[..., 0]
    segment_ids = token_runs.read_tokens(generated, "segment_ids")
    empty = np.flatnonzero(np.all((segment_ids == 0) |
                                  (generated_ids == layout.GENERATED_UNUSED), axis=1))
    assert len(empty)  # rows_per_shard 1: such a row is a block
    assert not any(os.path.exists(os.path.join(generated, layout.activation_shard_key(
        "final_norm", int(r)))) for r in empty)
    assert not token_runs.read_activation(generated, "final_norm")[empty].any()
    code, out = _cli("verify", generated)
    assert code == 0 and "OK: every committed block matches its checksum" in out, out
    # The reader reads them as the zeros they are, not as lost (reader.shard_presence).
    import actx

    run = actx.open_run(generated)
    np.testing.assert_array_equal(run.rows("final_norm", 0, run.total_rows),
                                  token_runs.read_activation(generated, "final_norm"))
    served = (segment_ids > 0) & (generated_ids != layout.GENERATED_UNUSED)  # room: never
    assert sum(len(b.rows) for b in run.stream("final_norm", 8, seed=0, epochs=1,
                                               drop_last=False)) == served.sum()


def _rewrite(run: str, hook: str, row: int, col: int, change) -> None:
    """Sets the stored value of `hook` at (row, col) to change(value) and rewrites its
    block's checksum to match, as a faulty writer would: a plain verify cannot see it."""
    s, loc = store.open_store(run), uri.parse(run)
    arr = ts_context.open_array(layout.array_spec(loc, layout.activation_array_key(hook)))
    for pid in sorted(commit.committed_partitions(s)):
        key = layout.commit_key(pid)
        marker = s.read_json(key)
        lo = marker["row_start"]
        if not lo <= row < lo + marker["row_count"]:
            continue
        block = (row - lo) // marker["block_rows"]
        start = lo + block * marker["block_rows"]
        stop = min(start + marker["block_rows"], lo + marker["row_count"])
        arr[row, col].write(change(arr[row, col].read().result())).result()
        marker["checksums"][hook][block] = commit.array_checksum(arr[start:stop].read().result())
        with open(os.path.join(run, key), "w") as f:
            json.dump(marker, f)
        return
    raise AssertionError(f"row {row} is in no committed partition")


def test_verify_reference_catches_a_changed_generated_value_and_a_nonzero_unused_one(
        generated, tmp_path):
    run = shutil.copytree(generated, tmp_path / "run")
    samples = _samples(str(run))
    stopped = next(d for d, s in samples.items() if (s["ids"] == layout.GENERATED_UNUSED).any())
    answered = next(d for d, s in samples.items() if d != stopped)
    s = samples[answered]
    i = int(np.flatnonzero(s["ids"] >= 0)[-1])  # its last generated token
    _rewrite(str(run), "layers.1.resid_post", int(s["rows"][i]), int(s["cols"][i]),
             lambda v: v * np.float32(1.01))
    t = samples[stopped]
    j = int(np.flatnonzero(t["ids"] == layout.GENERATED_UNUSED)[-1])
    _rewrite(str(run), "final_norm", int(t["rows"][j]), int(t["cols"][j]),
             lambda v: v + np.float32(1e-3))
    code, out = _cli("verify", run)
    assert code == 0, out  # the checksums match
    code, out = _cli("verify", run, "--reference", "--sample", "10")
    assert code == 1, out
    record = reference_verification.read_record(store.open_store(str(run)))
    assert len(record.failures) == 2, record.failures
    assert not record.ok and record.at > 1.7e9  # a time, never the worst token's index
    changed, nonzero = sorted(record.failures, key=lambda f: f"document {stopped} " in f)
    assert changed.startswith(f"document {answered} (doc_index ") and \
        "hook layers.1.resid_post: relative error " in changed
    assert f"worst at token {i} of {len(s['ids'])}, row {int(s['rows'][i])} column " \
           f"{int(s['cols'][i])}" in changed
    assert nonzero.startswith(f"document {stopped} (doc_index ") and (
        f"hook final_norm: 1 of the {int((t['ids'] == layout.GENERATED_UNUSED).sum())} "
        f"position(s) the sample did not reach") in nonzero
    assert f"first at token {j}, row {int(t['rows'][j])} column {int(t['cols'][j])}" in nonzero
    assert changed in out and nonzero in out
