"""The Slurm target: a GPU (or CPU) cluster driven through `sbatch`, `squeue` and `scancel`.

  settings.py  `target.slurm`: the sbatch flags (partition, account, gres, nodes, time, ...)
  plan.py      the sbatch script and the commands a launch, a rerun and `down` run
  step.py      what each task of the job step runs: its place from Slurm's environment,
               then the worker under deploy/detached/host_run.py
  target.py    the Target: prepare here, submit the array, the detached lease, `--wait`

Built on deploy/detached/ (lease, host start-up, follow), as the tpu-vm target is.
"""
