"""How hosts and replicas agree: `distributed` (the hosts of one replica joined by
jax.distributed, and their few collectives), `stop` (SIGTERM: the step all hosts stop at),
`choice_policy` (which partition a replica takes next when replicas share work) and
`chooser` (that policy against the run's store: reading claims, claiming)."""
