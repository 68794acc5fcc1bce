"""The tpu-vm target: a Cloud TPU VM slice driven through gcloud, its workers detached.

  accelerators.py  Cloud TPU accelerator types: what "v4-32" or "v5litepod-16" means
  plan.py          the gcloud commands: create the slice, install actx, start the hosts'
                   workers, delete it (`actx down`)
  package.py       the wheel of actx that the slice's hosts install
  lease.py         the run's job lease on the slice's hosts (deploy/detached/lease.py)
  follow.py        `--wait`: follow the job from the run (deploy/detached/follow.py)
  target.py        the Target: the plan under the lease, then `--wait`

Built on deploy/detached/ (lease, host start-up, follow), as the Slurm target is.
"""
