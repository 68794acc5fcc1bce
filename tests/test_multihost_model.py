"""Two local processes x 2 CPU devices, one jax.distributed mesh: same activations as one
process (the stand-in for a multi-host TPU slice)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests import hf_models, worker_procs
from actx.workers.model import capture, step
from actx.workers.model import decoder as model_lib

HOOKS = "layers.0.resid_mid,layers.1.resid_post,final_norm"
NUM_PROCESSES = 2
TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes_match_single_process(tmp_path):
    ckpt = hf_models.make_tiny_checkpoint(tmp_path / "ckpt", "llama3", num_hidden_layers=2)
    rng = np.random.RandomState(0)
    batch, seq = 8, 16
    ids = rng.randint(1, 512, (batch, seq)).astype(np.int32)
    seg = np.ones((batch, seq), np.int32)
    seg[::2, 9:] = 2
    seg[5, 12:] = 0
    pos = np.where(seg == 2, np.arange(seq) - 9, np.arange(seq)).astype(np.int32)
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, input_ids=ids, positions=pos, segment_ids=seg, hooks=np.array(HOOKS))

    env = dict(os.environ, XLA_FLAGS=worker_procs.xla_flags(2),
               JAX_PLATFORMS="cpu")
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "tests.multihost_model_worker", str(i), str(NUM_PROCESSES),
         str(port), ckpt, str(inputs), str(tmp_path)],
        env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(NUM_PROCESSES)]
    failures = []
    for i, proc in enumerate(procs):
        try:
            _, stderr = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            _, stderr = proc.communicate()
            failures.append(f"process {i} timed out after {TIMEOUT_S}s:\n{stderr[-4000:]}")
            continue
        if proc.returncode:
            failures.append(f"process {i} exited {proc.returncode}:\n{stderr[-4000:]}")
    if failures:
        pytest.fail("\n\n".join(failures))

    model = model_lib.load_pretrained(ckpt)
    expected = step.make_extract_fn(model, capture.CaptureSpec.parse(HOOKS))(ids, pos, seg)
    for mesh_name in ("2x2", "4x1"):
        got: dict[str, np.ndarray] = {}
        for i in range(NUM_PROCESSES):
            part = np.load(tmp_path / f"{mesh_name}.p{i}.npz")
            assert len(part["rows"]) == batch // NUM_PROCESSES  # each holds only its rows
            for name in expected:
                got.setdefault(name, np.zeros(expected[name].shape, np.float32))
                got[name][part["rows"]] = part[name]
        for name, ref in expected.items():
            ref = np.asarray(ref)
            err = np.max(np.abs(got[name] - ref)) / np.max(np.abs(ref))
            assert err <= 1e-6, (mesh_name, name, err)
