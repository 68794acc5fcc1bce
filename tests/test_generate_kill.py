"""A generating worker SIGKILLed mid-generation (`ACTX_CRASH_AT=step:N`, workers.loop.faults:
the N-th generation step, no last heartbeat, nothing of the partition in hand committed),
then the command the launcher advises, typed as printed, finishes the run: byte for byte
what an uninterrupted run of the same spec stores (activations, generated.token_ids,
sample records). Real Beam prepare, real worker processes under the local target."""

from __future__ import annotations

import io
import re
import shlex

from actx.deploy import cli
from actx.pipeline import main as prepare_main
from actx.schemas import commit, runspec, store
from tests import generate_runs, worker_procs


def _cli(argv) -> tuple[int, str]:
    out = io.StringIO()
    return cli.main(argv, out=out), out.getvalue()


def test_a_worker_killed_mid_generation_then_rerun_stores_what_an_uninterrupted_run_does(
        tmp_path, qwen_tokenizer_dir, monkeypatch):
    model = generate_runs.tiny_qwen2(tmp_path / "qwen2")
    prompts = generate_runs.write_prompts(tmp_path / "prompts.jsonl",
                                          generate_runs.PROMPTS[:2] + generate_runs.PROMPTS[4:])
    spec = runspec.RunSpec.from_dict(generate_runs.spec_dict(
        model, qwen_tokenizer_dir, prompts, max_context=96, rows_per_shard=1,
        partition_rows=2, max_new_tokens=12, temperature=1.0, top_k=50,
        samples_per_prompt=2, seed=9, stop_token_ids=[generate_runs.STOP]))
    run = str(tmp_path / "run")
    m = prepare_main.run_prepare(spec, run, ["--runner=FnApiRunner"])
    n = len(m.partitions)
    assert n >= 3
    reference = worker_procs.copy_token_store(run, str(tmp_path / "reference"))
    # Every attempt with the local target's defaults (one process, one device), as the
    # advised command runs: the same slots and mesh, so the same bytes.

    # A partition takes a prefill step and up to 13 decode steps: the 20th step is in the
    # middle of generating the second one.
    monkeypatch.setenv("ACTX_CRASH_AT", "step:20")
    code, out = _cli(["rerun", run, "--job", "killed"])
    assert code == 1 and "killed by SIGKILL" in out, out
    s = store.open_store(run)
    done = commit.committed_partitions(s)
    assert 0 < len(done) < n, (done, out)
    advised = set(re.findall(r"`(actx rerun [^`]*)`", out))
    assert advised == {f"actx rerun {run}"}, out

    monkeypatch.delenv("ACTX_CRASH_AT")
    [command] = advised
    code, out = _cli(shlex.split(command)[1:])
    assert code == 0, out
    assert commit.committed_partitions(s) == set(range(n))
    code, out = _cli(["rerun", reference, "--job", "whole"])
    assert code == 0, out
    assert generate_runs.stored_run(run) == generate_runs.stored_run(reference)
    assert cli.main(["verify", run], out=io.StringIO()) == 0
