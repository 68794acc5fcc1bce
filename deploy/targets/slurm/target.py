"""The slurm target: prepare here (or on Dataflow with `prepare: dataflow`), then one
`sbatch` of an array (deploy/targets/slurm/plan.py), one replica per array task, whose workers run
detached from this command. The run's job lease is held by the hosts' heartbeats
(deploy/detached/lease.py); `--wait` follows the job from the run
(deploy/detached/follow.py); `actx down` cancels the job (`scancel`)."""

from __future__ import annotations

import os

from actx.deploy import commands
from actx.deploy import targets
from actx.deploy.detached.target import DetachedTarget
from actx.deploy.targets.slurm import plan as slurm_plan
from actx.schemas import advice


class SlurmTarget(DetachedTarget):
    kind = slurm_plan.KIND
    hosts_are = "a Slurm job"

    def plan_problems(self, run: str) -> list[str]:
        return slurm_plan.problems(run, self.config)

    def submit(self, job: targets.Job, prepare: targets.Prepare, opts: targets.LaunchOptions,
               out) -> int:
        from actx.deploy.targets.dataflow import plan as dataflow

        plan, script = self._plan(job, opts, self.prepare_commands(job, prepare))
        if opts.dry_run:
            code = targets.show_plan(plan, out, dataflow.spec_file(prepare.spec, job.name))
            return self._show_script(job, script, out) or code
        dataflow.write_spec_file(prepare.spec, job.name)
        return self._launch(plan, script, job, opts, out, prepare.retry_argv,
                            prepare.write_records)

    def rerun(self, job: targets.Job, opts: targets.LaunchOptions, out) -> int:
        plan, script = self._plan(job, opts)
        if opts.dry_run:
            code = targets.show_plan(plan, out)
            return self._show_script(job, script, out) or code
        return self._launch(plan, script, job, opts, out)

    def hosts_and_replicas(self) -> tuple[int, int]:
        slurm = self.config.slurm
        return slurm.replicas * slurm.nodes, slurm.replicas

    def log_every_s(self) -> float:
        return self.config.slurm.log_every_s

    def down(self, run: str | None, opts: targets.LaunchOptions, out) -> int:
        """Cancels this config's jobs (scancel, yours of target.slurm.name)."""
        plan = [slurm_plan.cancel_command(self.config.slurm)]
        if opts.dry_run:
            return targets.show_plan(plan, out)
        code = commands.execute(plan, out=out)
        if code == 0:  # its tasks are gone: a rerun must not wait for their last heartbeats
            from actx.deploy.detached import lease

            lease.release(run, self.kind, slurm_plan.host_names(self.config.slurm), out)
        return code

    # -------------------------------------------------------------------------------------
    def _plan(self, job: targets.Job, opts: targets.LaunchOptions, prepare=()):
        """(the commands, the batch script); checks the target first: nothing is
        submitted on bad input."""
        slurm_plan.check(job.run.uri, self.config)
        script = slurm_plan.script(job.run.uri, self.config, job.fingerprint, job.name, job.only,
                                   job.extraction)
        return [*prepare, slurm_plan.submit_command(self.config.slurm, job.name,
                                                    opts.config)], script

    @staticmethod
    def _show_script(job: targets.Job, script: str, out) -> int:
        print(f"# {slurm_plan.script_path(job.name)}:", file=out)
        print("".join(f"#   {line}\n" for line in script.splitlines()), end="", file=out,
              flush=True)
        return 0

    def _launch(self, plan, script: str, job: targets.Job, opts: targets.LaunchOptions, out,
                retry_argv: list[str] | None = None, records=None) -> int:
        """Writes the batch script and runs the plan under the run's detached job lease
        (taken over from a job Slurm no longer runs), after `records`, the job's own
        records; then says where the workers are, and follows them with --wait."""
        from actx.deploy.detached import follow as detached_follow
        from actx.deploy.detached import launch, lease

        slurm = self.config.slurm

        def write_script() -> None:
            path = slurm_plan.script_path(job.name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.makedirs(slurm_plan.output_dir(slurm, job.name), exist_ok=True)
            with open(path, "w") as f:
                f.write(script)

        def follow(started_at: float) -> int:
            return detached_follow.follow(
                job.run, f"{slurm.name}-r", started_at, job.only, out=out,
                every_s=min(5.0, max(0.5, self.config.heartbeat_s)),
                stale_after_s=opts.stale_after_s, extraction=job.extraction,
                job=job.name, where="the cluster",
                look=f"Slurm's output in {slurm_plan.output_dir(slurm, job.name)}",
                rerun=f"`{advice.rerun_on(job.run.uri, 'slurm', opts.config)}` redoes them")

        return launch.launch(
            plan, job, opts, out, config=self.config, retry_argv=retry_argv,
            records=records, before=write_script, follow=follow,
            take=lambda: lease.take(
                job.run, self.kind, slurm_plan.host_names(slurm), job.name,
                stop=f"`{advice.down(opts.config)}` (scancel of your jobs named "
                     f"{slurm.name})", out=out, gone=self._gone),
            running=f"as Slurm job {slurm.name}",
            stop=f"cancel it: {advice.down(opts.config)}")

    def _gone(self, held) -> str | None:
        """Why the job that holds the run (of this config's name) runs no worker: Slurm
        has none of its tasks pending or running (None: it may, or squeue did not say)."""
        if slurm_plan.running(self.config.slurm) == "":
            return f"no Slurm job named {self.config.slurm.name} is pending or running"
        return None
