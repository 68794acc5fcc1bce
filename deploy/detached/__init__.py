"""What every detached target shares: workers that run on hosts of their own, outliving
the command that started them.

  lease.py     the run's job lease held by the hosts' heartbeats: taken before the launch,
               given back when it fails, taken over from a job whose hosts are gone,
               released by `actx down`
  launch.py    the target's plan run under that lease, then where the workers are, and
               `--wait`
  host_run.py  what each host runs: the worker, its log copied into the run as it grows,
               its death recorded
  follow.py    `--wait`: follow the job from the run directory until it ends
  target.py    `DetachedTarget`: the refusals and the prepare step the targets share

The TPU VM target (deploy/targets/tpu_vm/) and the Slurm target (deploy/targets/slurm/) are
built on these; each adds only where its hosts come from and what it names them.
"""
