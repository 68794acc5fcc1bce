"""A generating run on a replica of two hosts: two worker processes joined by
jax.distributed on the CPU, the model on a mesh spanning them, run in lockstep through
`actx submit` on the local target (target.hosts: 2, hosts_per_replica: 2). What they
store (every activation array's bytes, generated.token_ids, the sample records) is byte
for byte what one host with the same mesh (two devices) stores for the same spec, sampled
with two samples a prompt, also with the partitions chosen one at a time (as when
replicas share work), and every token is HF transformers' (workers/generate/worker.py,
docs/generate.md)."""

from __future__ import annotations

import io
import json

import pytest

from actx.deploy import cli
from actx.schemas import commit, store
from tests import generate_runs, worker_procs

MAX_NEW = 12
STOP = generate_runs.STOP
# Three prompts, 2-row partitions: documents (and answers) cross rows and partitions, and
# each host writes one shard of every partition.
PROMPTS = generate_runs.PROMPTS[:2] + generate_runs.PROMPTS[4:]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return generate_runs.tiny_qwen2(tmp_path_factory.mktemp("m") / "qwen2")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    return generate_runs.write_prompts(tmp_path_factory.mktemp("in") / "prompts.jsonl",
                                       PROMPTS)


def _spec(model, tokenizer, prompts, **generate) -> dict:
    return generate_runs.spec_dict(model, tokenizer, prompts, max_context=96,
                                   rows_per_shard=1, partition_rows=2,
                                   max_new_tokens=MAX_NEW, stop_token_ids=[STOP], **generate)


def _two_hosts(tmp_path, spec: dict) -> str:
    run = str(tmp_path / "two")
    config = tmp_path / "two.yaml"
    config.write_text(json.dumps({
        "run": run, "spec": spec,
        "target": {"kind": "local", "hosts": 2, "hosts_per_replica": 2, "batch_size": 4,
                   "devices_per_host": 1}}))
    out = io.StringIO()
    assert cli.main(["submit", str(config), "--job", "two"], out=out) == 0, out.getvalue()
    assert "(1 replica(s) x 2 host(s)" in out.getvalue(), out.getvalue()
    s = store.open_store(run)
    n = len(s.read_json("manifest.json")["partitions"]["id"])
    assert commit.committed_partitions(s) == set(range(n)) and n >= 2
    assert commit.read_marker(s, 0).hosts == ("r0h0", "r0h1")
    return run


def test_two_hosts_store_what_one_host_stores_and_hf_computes(
        model, qwen_tokenizer_dir, prompts_file, tmp_path):
    # Sampled, two samples a prompt, with a repetition penalty (its record of fed ids
    # split over the mesh): the harder case. Greedy ids equal HF `generate`'s on one host
    # (tests/test_generate_run.py), and two hosts store one host's bytes.
    spec = _spec(model, qwen_tokenizer_dir, prompts_file, temperature=1.0, top_k=50,
                 samples_per_prompt=2, seed=3, repetition_penalty=1.3)
    two = _two_hosts(tmp_path, spec)
    one = str(tmp_path / "one")
    worker_procs.copy_token_store(two, one)
    # One host with the same mesh (2 devices on `data`, 2 slots each): the same steps,
    # whose matmuls then have the same shapes. (On one device of 4 slots XLA rounds some
    # values differently, ~1e-8: as any change of the slot count or mesh may.)
    code, out = worker_procs.run_worker(["--run", one, "--batch-size", "4"], devices=2)
    assert code == 0, out
    stored = generate_runs.stored_run(one)
    assert any("generated.token_ids" in k for k in stored)
    assert generate_runs.stored_run(two) == stored
    found = generate_runs.records(two)
    assert len(found) == 2 * len(PROMPTS)
    generate_runs.assert_every_token_is_hf(two, model, qwen_tokenizer_dir, PROMPTS, MAX_NEW,
                                           STOP, samples_per_prompt=2, greedy=False)
    assert cli.main(["verify", two], out=io.StringIO()) == 0
    # The prompts' tokens each marker records (a generating worker reads no segment ids).
    assert worker_procs.assert_markers_record_the_tokens(two, ("input_ids", "positions")) >= 1
    # Process 0 choosing as it goes (work sharing: distributed.LeaderSequence).
    shared = worker_procs.copy_token_store(two, str(tmp_path / "shared"))
    for code, out in worker_procs.run_replica(
            shared, hosts=2, devices_per_host=1,
            extra=["--batch-size", "4", "--steal", "--job", "shared"]):
        assert code == 0, out
    assert generate_runs.stored_run(shared) == stored
