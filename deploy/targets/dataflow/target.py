"""The dataflow target: prepare on Dataflow (deploy/targets/dataflow/plan.py); with `extract: beam`,
extraction too, as the ExtractPartitions transform on Dataflow's GPU or TPU workers
(deploy/targets/beam.py). With `extract: workers` the run is extracted afterwards on
another target (`actx rerun RUN --config CONFIG --target tpu-vm`)."""

from __future__ import annotations

from actx.deploy import commands
from actx.deploy import targets
from actx.schemas import advice
from actx.schemas import errors


class DataflowTarget(targets.Target):
    kind = "dataflow"

    def problems(self, run: str) -> tuple[list[str], int | None]:
        from actx.deploy.targets.dataflow import plan as dataflow

        found = []
        try:
            dataflow.check(run, self.config.dataflow)
        except errors.UserError as e:
            found.append(str(e))
        if self.config.extract == "beam":
            from actx.deploy.targets import beam as beam_target

            found += beam_target.problems(run, self.config)
        return found, None

    def stop_hint(self) -> str:
        return "A Dataflow job stops with `gcloud dataflow jobs cancel JOB_ID --region REGION`"

    def peak_flops(self) -> tuple[float, str] | tuple[None, str]:
        if self.config.extract != "beam":
            return None, ("the dataflow target only prepares here; the extraction's time is "
                          "the target's that runs it (`actx rerun RUN --config` there)")
        from actx.deploy.targets.dataflow import accelerators

        return accelerators.worker_peak(self.config.dataflow.extract_accelerator,
                                        self.config.dataflow.max_num_workers)

    def hosts_and_replicas(self) -> tuple[int, int]:
        # Extraction through Beam: each Dataflow worker process is a one-host replica (its
        # most: dataflow.max_num_workers; 0, autoscaled, is counted as one).
        if self.config.extract == "beam":
            workers = max(1, self.config.dataflow.max_num_workers)
            return workers, workers
        return super().hosts_and_replicas()

    def submit(self, job: targets.Job, prepare: targets.Prepare, opts: targets.LaunchOptions,
               out) -> int:
        from actx.deploy.targets.dataflow import plan as dataflow

        run = job.run.uri  # the commands' argument: the store is never opened here
        if not run.startswith("gs://"):
            raise targets.UsageError(f"run {run!r}: Dataflow workers need a gs:// run "
                                     f"directory")
        plan = dataflow.prepare_commands(prepare.spec, run, self.config,
                                         prepare.max_reject_fraction, True, job.name)
        beam = self.config.extract == "beam"
        if beam:  # then extraction on Dataflow GPU or TPU workers
            from actx.deploy.targets import beam as beam_target

            plan = plan + [beam_target.dataflow_command(prepare.spec, run, self.config,
                                                        job.name, extraction=job.extraction)]
        if opts.dry_run:
            return targets.show_plan(plan, out, dataflow.spec_file(prepare.spec, job.name))
        dataflow.write_spec_file(prepare.spec, job.name)
        prepare.write_records()  # no job lease here: Dataflow prepares, workers extract later
        code = commands.execute(plan, out=out, poll_s=self.config.tpu.poll_s,
                                in_process=targets.prepare_in_process(prepare.retry_argv))
        if code == 0 and not beam:
            print(f"prepared {run} on Dataflow; extract it with "
                  f"`{advice.rerun_on(run, 'tpu-vm', 'CONFIG')}` (or --target local)",
                  file=out)
        return code

    def rerun(self, job: targets.Job, opts: targets.LaunchOptions, out) -> int:
        raise targets.UsageError("rerun extracts; Dataflow only prepares. Use --target local "
                                 "or tpu-vm")
