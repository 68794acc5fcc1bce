"""The submit config the Slurm tests run (tests/test_slurm_target.py against the simulated
cluster, tests/test_slurm_real.py against a real one): a tiny Qwen2 checkpoint, 200 short
documents in partitions of 8 rows, a slurm target of `nodes` nodes of one CPU device each
running this interpreter, and the local config whose run is the reference byte for byte
(one process with the nodes' devices: the same rows per device)."""

from __future__ import annotations

import socket
import sys

import yaml

from tests import hf_models, worker_procs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write(tmp_path, tokenizer_dir: str, name: str, nodes: int, docs: int = 200,
          rows_per_shard: int = 4, **slurm) -> tuple[str, dict]:
    """(the config's path, the config) of a run under tmp_path, in partitions of 8 rows
    (with rows_per_shard 8, a partition's rows are all its replica's rank 0's); `slurm`:
    more target.slurm keys."""
    model = hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", num_hidden_layers=2,
                                           vocab_size=151936)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(f'{{"text": "document {i} says {" and ".join(["more"] * (i % 7))}"}}\n'
                            for i in range(docs)))
    cfg = {
        "run": str(tmp_path / "run"),
        "spec": {"name": "slurm", "model": {"path": str(model), "dtype": "float32"},
                 "tokenizer": {"path": tokenizer_dir},
                 "sources": [{"kind": "text", "name": "docs", "paths": [str(path)]}],
                 "packing": {"mode": "segmented", "seq_len": 32},
                 "capture": {"hooks": "layers.*.resid_post", "dtype": "bfloat16"},
                 "layout": {"rows_per_shard": rows_per_shard, "partition_rows": 8}},
        "target": {"kind": "slurm", "batch_size": 4, "heartbeat_s": 1, "stop_check_steps": 1,
                   "slurm": {"name": name, "nodes": nodes, "python": sys.executable,
                             "coordinator_port": free_port(), "log_every_s": 1,
                             "output_dir": str(tmp_path / "slurm-out"),
                             "env": {"JAX_PLATFORMS": "cpu",
                                     "XLA_FLAGS": worker_procs.xla_flags(1)},
                             **slurm}},
    }
    out = tmp_path / "slurm.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return str(out), cfg


def write_local(tmp_path, cfg: dict, nodes: int) -> tuple[str, dict]:
    """The same spec on the local target, one host with `nodes` devices, in its own run."""
    local = dict(cfg, run=str(tmp_path / "local-run"),
                 target={"kind": "local", "hosts": 1, "devices_per_host": nodes,
                         "batch_size": cfg["target"]["batch_size"]})
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(local))
    return str(path), local
