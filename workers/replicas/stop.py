"""SIGTERM: a worker stops between steps, and the hosts of a replica agree on the step.

One-host replicas look at the signal every step (free). The hosts of a multi-host replica
must stop at the same step, so they look every `stop_check_steps` steps, in a collective:
the runner's loop through `distributed.any_process`, the partition stream in the
all-gather it makes there anyway (workers.loop.partition_stream). Either way a stop the replica
agreed on raises Preempted, and nothing of the partition in hand is committed.
"""

from __future__ import annotations

import threading


class Preempted(Exception):
    """SIGTERM arrived; the partition in hand was not committed."""


class StopSignal:
    """This process's SIGTERM (`requested`) and when its replica looks at it."""

    def __init__(self, hosts_per_replica: int, check_steps: int):
        self.requested = threading.Event()
        self.multi_host = hosts_per_replica > 1
        self.check_steps = max(1, check_steps)

    def due(self, step_index: int) -> bool:
        """Whether the replica looks at SIGTERM at this step (the hosts all ask the same)."""
        return not self.multi_host or step_index % self.check_steps == 0

    def stop_if(self, agreed: bool, step_index: int, where: str) -> None:
        """Raises Preempted when the replica agreed to stop at this step."""
        if agreed:
            raise Preempted(f"stopped at step {step_index} of {where}")
