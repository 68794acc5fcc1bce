"""What a detached target's `Target` shares (tpu-vm, slurm): its refusals, and the prepare
step its plan starts with."""

from __future__ import annotations

from actx.deploy import targets


class DetachedTarget(targets.Target):
    """A target whose hosts run the workers themselves. A subclass names them in
    `hosts_are` ("a TPU slice", as the refusal of Beam extraction says) and gives its
    plan's own checks in `plan_problems`."""

    hosts_are = "its hosts"

    def plan_problems(self, run: str) -> list[str]:
        """What the target's plan refuses (its settings, the batch against the hosts'
        devices)."""
        raise NotImplementedError

    def problems(self, run: str) -> tuple[list[str], int | None]:
        # The plan's checks count the batch against the hosts' devices themselves.
        return self.plan_problems(run) + self.beam_extract_problem(self.hosts_are), None

    def prepare_commands(self, job: targets.Job, prepare: targets.Prepare) -> list:
        """The commands that prepare the run before the hosts start: here, or on Dataflow
        with `prepare: dataflow`."""
        from actx.deploy.targets.dataflow import plan as dataflow

        return dataflow.prepare_commands(prepare.spec, job.run.uri, self.config,
                                         prepare.max_reject_fraction,
                                         self.config.prepare == "dataflow", job.name)
