"""The per-host loop: `runner` (Worker: it dispatches steps and nothing else), `session`
(one partition to its commit), `partition_stream` (partitions through the batch slots with
no barrier), `schedule` (which rows each step runs), `prefetch`, `transfer`, `outputs` (a
step's outputs off the dispatching thread), `progress` (heartbeats), `admission` (may this
worker write into the run), `model_groups` (several models at once), `faults` (crash
points for the tests)."""
