"""The tpu-vm target: a plan of gcloud commands (deploy/targets/tpu_vm/plan.py) that
requests the slice, prepares (here, or on Dataflow with `prepare: dataflow`), installs actx
and starts one worker per host, detached. The run's job lease is held by the slice's
heartbeats (deploy/targets/tpu_vm/lease.py over deploy/detached/lease.py); `--wait` follows
the job from the run (deploy/targets/tpu_vm/follow.py over deploy/detached/follow.py);
`actx down` deletes the slice."""

from __future__ import annotations

from actx.deploy import commands
from actx.deploy import targets
from actx.deploy.detached.target import DetachedTarget
from actx.deploy.targets.tpu_vm import plan as tpu_vm
from actx.schemas import advice


class TpuVmTarget(DetachedTarget):
    kind = "tpu-vm"
    hosts_are = "a TPU slice"

    def plan_problems(self, run: str) -> list[str]:
        return tpu_vm.problems(run, self.config)

    def submit(self, job: targets.Job, prepare: targets.Prepare, opts: targets.LaunchOptions,
               out) -> int:
        from actx.deploy.targets.dataflow import plan as dataflow

        # The plan checks the target first: nothing is created on bad input.
        plan = tpu_vm.plan(job.run.uri, self.config, job.fingerprint, job.name,
                           prepare=self.prepare_commands(job, prepare), config=opts.config,
                           extraction=job.extraction)
        if opts.dry_run:
            return targets.show_plan(plan, out, dataflow.spec_file(prepare.spec, job.name))
        dataflow.write_spec_file(prepare.spec, job.name)
        return self._launch(plan, job, opts, out, prepare.retry_argv, prepare.write_records)

    def rerun(self, job: targets.Job, opts: targets.LaunchOptions, out) -> int:
        plan = tpu_vm.plan(job.run.uri, self.config, job.fingerprint, job.name, only=job.only,
                           create=False, install=opts.install, recreate=opts.recreate,
                           config=opts.config, extraction=job.extraction)
        if opts.dry_run:
            return targets.show_plan(plan, out)
        return self._launch(plan, job, opts, out)

    def peak_flops(self) -> tuple[float, str]:
        from actx.deploy.targets.tpu_vm import accelerators

        shape = accelerators.parse(self.config.tpu.accelerator_type)
        return (shape.chips * shape.chip_tflops * 1e12,
                f"a {shape.accelerator_type} ({shape.chips} chips x {shape.chip_tflops:g} "
                f"TFLOP/s bf16)")

    def hosts_and_replicas(self) -> tuple[int, int]:
        return tpu_vm.slice_hosts(self.config.tpu), 1  # the whole slice is one replica

    def log_every_s(self) -> float:
        return self.config.tpu.log_every_s

    def down(self, run: str | None, opts: targets.LaunchOptions, out) -> int:
        """Deletes the slice (refused for one that submit did not create)."""
        plan = tpu_vm.down_plan(self.config.tpu)
        if opts.dry_run:
            return targets.show_plan(plan, out)
        code = commands.execute(plan, out=out)
        if code == 0:  # its hosts are gone: a rerun must not wait for their last heartbeats
            from actx.deploy.targets.tpu_vm import lease as tpu_lease

            tpu_lease.release_for_down(run, self.config.tpu, out)
        return code

    # -------------------------------------------------------------------------------------
    def _launch(self, plan, job: targets.Job, opts: targets.LaunchOptions, out,
                retry_argv: list[str] | None = None, records=None) -> int:
        """Runs the plan under the run's detached job lease (deploy.targets.tpu_vm.lease: taken over
        from a job whose slice is preempted or gone), after `records`, the job's own
        records; then says where the workers are, and follows them with --wait."""
        from actx.deploy.detached import launch
        from actx.deploy.targets.tpu_vm import follow as tpu_follow
        from actx.deploy.targets.tpu_vm import lease as tpu_lease

        tpu = self.config.tpu

        def follow(started_at: float) -> int:
            return tpu_follow.follow(job.run, f"{tpu.name}-w", started_at, job.only,
                                     config=opts.config, out=out,
                                     every_s=min(5.0, max(0.5, self.config.heartbeat_s)),
                                     stale_after_s=opts.stale_after_s,
                                     extraction=job.extraction, job=job.name)

        return launch.launch(
            plan, job, opts, out, config=self.config, poll_s=tpu.poll_s,
            retry_argv=retry_argv, records=records, follow=follow,
            take=lambda: tpu_lease.take(job.run, self.config, job.name, opts.config,
                                        out),
            running=f"on {tpu.name}",
            stop=f"delete the slice afterwards: {advice.down(opts.config)}")
