"""The tpu-vm target: a plan of gcloud commands (deploy/tpu_vm.py) that requests the slice,
prepares (here, or on Dataflow with `prepare: dataflow`), installs actx and starts one
worker per host, detached. The run's job lease is held by the slice's heartbeats
(deploy/tpu_lease.py over deploy/detached/lease.py); `--wait` follows the job from the
run (deploy/tpu_follow.py over deploy/detached/follow.py);
`actx down` deletes the slice."""

from __future__ import annotations

import contextlib
import time

from actx.deploy import commands
from actx.deploy import targets
from actx.deploy import tpu_vm
from actx.schemas import layout


class TpuVmTarget(targets.Target):
    kind = "tpu-vm"

    def problems(self, run: str) -> tuple[list[str], int | None]:
        # tpu_vm.problems checks the batch against the slice's chips itself.
        found = tpu_vm.problems(run, self.config)
        if self.config.extract == "beam":
            found.append('target.extract: "beam" runs on Beam runners (kind "local" or '
                         '"dataflow"); a TPU slice runs the workers themselves')
        return found, None

    def spec_problems(self, spec) -> list[str]:
        try:  # an unknown type is tpu_vm.problems' to name
            shape = tpu_vm.slice_shape(self.config.tpu)
        except tpu_vm.TargetError:
            return []
        return targets.generate_multihost(
            spec, shape.hosts, f"the {shape.accelerator_type} slice is one replica of "
                               f"{shape.hosts} hosts",
            "use a one-host slice for target.tpu.accelerator_type (e.g. v4-8, v5litepod-8, "
            "v6e-8)")

    def submit(self, job: targets.Job, prepare: targets.Prepare, opts: targets.LaunchOptions,
               out) -> int:
        from actx.deploy import dataflow

        prep = dataflow.prepare_commands(prepare.spec, job.run, self.config,
                                         prepare.max_reject_fraction,
                                         self.config.prepare == "dataflow", job.name)
        # The plan checks the target first: nothing is created on bad input.
        plan = tpu_vm.plan(job.run, self.config, job.fingerprint, job.name, prepare=prep,
                           config=opts.config, extraction=job.extraction)
        if opts.dry_run:
            return targets.show_plan(plan, out, dataflow.spec_file(prepare.spec, job.name))
        dataflow.write_spec_file(prepare.spec, job.name)
        return self._launch(plan, job, opts, out, prepare.retry_argv, prepare.write_records)

    def rerun(self, job: targets.Job, opts: targets.LaunchOptions, out) -> int:
        plan = tpu_vm.plan(job.run, self.config, job.fingerprint, job.name, only=job.only,
                           create=False, install=opts.install, recreate=opts.recreate,
                           config=opts.config, extraction=job.extraction)
        if opts.dry_run:
            return targets.show_plan(plan, out)
        return self._launch(plan, job, opts, out)

    def down(self, run: str | None, opts: targets.LaunchOptions, out) -> int:
        """Deletes the slice (refused for one that submit did not create)."""
        plan = tpu_vm.down_plan(self.config.tpu)
        if opts.dry_run:
            return targets.show_plan(plan, out)
        code = commands.execute(plan, out=out)
        if code == 0:  # its hosts are gone: a rerun must not wait for their last heartbeats
            from actx.deploy import tpu_lease

            tpu_lease.release_for_down(run, self.config.tpu, out)
        return code

    # -------------------------------------------------------------------------------------
    def _launch(self, plan, job: targets.Job, opts: targets.LaunchOptions, out,
                retry_argv: list[str] | None = None, records=None) -> int:
        """Runs the plan under the run's detached job lease (after `records`, the job's own
        records, written once the lease is held); then says where the workers are, and
        follows them with --wait."""
        started_at = time.time()
        with self._lease(job, opts, out) as failed:
            if records is not None:
                records()
            code = commands.execute(plan, out=out, poll_s=self.config.tpu.poll_s,
                                    in_process=targets.prepare_in_process(retry_argv))
            failed(code)
        if code != 0:  # the failed step said what to do
            return code
        if not opts.join:  # how `actx rerun RUN` launches next (deploy.launch_record)
            from actx.deploy import launch_record

            launch_record.record(job.run_store(), self.config, job.name)
        print(f"workers are running on {self.config.tpu.name}, detached from this command.\n"
              f"  progress: actx status {job.run} --watch\n"
              f"  logs:     {job.run.rstrip('/')}/{layout.log_key(job.name, '<host>')} "
              f"(copied as they grow)\n"
              f"  delete the slice afterwards: actx down --config {opts.config}",
              file=out, flush=True)
        if not opts.wait:
            return 0
        from actx.deploy import tpu_follow

        return tpu_follow.follow(job.run, f"{self.config.tpu.name}-w", started_at, job.only,
                                 config=opts.config, out=out,
                                 every_s=min(5.0, max(0.5, self.config.heartbeat_s)),
                                 stale_after_s=opts.stale_after_s,
                                 extraction=job.extraction, handle=job.handle,
                                 job=job.name)

    @contextlib.contextmanager
    def _lease(self, job: targets.Job, opts: targets.LaunchOptions, out=None):
        """Holds the run's detached job lease (deploy.tpu_lease), taken before the plan
        runs (over a job whose slice is preempted or gone); given back when the plan fails
        (`failed(code)`, nonzero) or raises, as its workers did not start."""
        from actx.deploy import tpu_lease
        from actx.deploy.detached import lease as detached_lease

        taken = (None if opts.join else  # joining: the lease is the joined job's
                 tpu_lease.take(job.run_store(), self.config, job.name, opts.config, out))
        with detached_lease.holding(taken) as failed:
            yield failed
