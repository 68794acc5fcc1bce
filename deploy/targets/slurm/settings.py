"""`target.slurm`: where and how the Slurm target's job runs (deploy/targets/slurm/)."""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class SlurmConfig:
    """A Slurm cluster driven through `sbatch`, `squeue` and `scancel`.

    name: the job's name (sbatch --job-name) and its hosts' (`<name>-r<replica>h<task>`);
      `actx down` cancels the jobs of this name (yours only): give each config its own.
    replicas: array tasks (sbatch --array=0-<replicas-1>), one replica each.
    nodes: nodes of one replica (sbatch --nodes); one job step runs one task per node,
      joined by jax.distributed.
    partition / account / qos / time / gres / constraint / mem / cpus_per_task: the
      sbatch flags of those names ("" or 0: not given, the cluster's default), e.g. gres
      "gpu:8", time "04:00:00".
    devices_per_node: JAX devices of one node (0: the count in gres "gpu:N", else 1);
      the pre-flight checks the batch against it.
    sbatch_args: more sbatch flags, passed through unchanged.
    setup: shell lines the batch script runs before the job step (module load, a
      virtual environment's activate).
    python: the interpreter on the nodes (with actx and JAX installed).
    env: extra environment variables for the worker processes.
    coordinator_port: port of jax.distributed's coordinator on a replica's first node
      (array task i uses coordinator_port + i).
    coordinator: how the tasks reach that node: "node_name", its Slurm name (it must
      resolve on every node, as host names do); "node_addr", its NodeAddr as `scontrol
      show node` gives it (a cluster whose node names are not host names).
    output_dir: where Slurm writes each array task's output (sbatch --output), on a
      filesystem this machine and the nodes share ("": ~/actx-slurm/<job>).
    log_every_s: seconds between copies of a host's log into <run>/logs/<job>/ (>= 1).
    """

    name: str = "actx"
    replicas: int = 1
    nodes: int = 1
    partition: str = ""
    account: str = ""
    qos: str = ""
    time: str = ""
    gres: str = ""
    constraint: str = ""
    mem: str = ""
    cpus_per_task: int = 0
    devices_per_node: int = 0
    sbatch_args: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    python: str = "python3"
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    coordinator_port: int = 8476
    coordinator: Literal["node_name", "node_addr"] = "node_name"
    output_dir: str = ""
    log_every_s: float = 10.0
