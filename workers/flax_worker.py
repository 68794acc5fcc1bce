"""The extraction worker for a run whose model is a user's Flax NNX model (`model.flax`).

`worker_for_run` gives `workers.runner.Worker` for a Hugging Face checkpoint and
`FlaxWorker` for a Flax model. FlaxWorker is the same loop, writers and commits; only what
it runs differs: the model comes from the factory (weights placed by their own sharding
annotations), hooks are module paths, every row is seen alone (no KV cache), and packing
modes the model cannot serve are refused before anything runs.

Its `__init__` mirrors `runner.Worker.__init__` line for line except where the model is
loaded and the hooks are sized; keep the two in step.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid

from schemas import commit as commit_lib
from schemas import run_dir, runspec, store, ts_context
from workers import (admission, flax_hooks, flax_model, flax_step, prefetch, progress,
                     runner, schedule, transfer, writer)


def worker_for_run(opts: runner.WorkerOptions) -> runner.Worker:
    """The worker that can run `opts.run`'s model."""
    ts_context.configure(opts.gcs_request_concurrency, opts.gcs_request_retries)
    spec = runspec.read_run_spec(store.open_store(opts.run))
    return FlaxWorker(opts) if spec.model.flax else runner.Worker(opts)


class FlaxWorker(runner.Worker):
    def __init__(self, opts: runner.WorkerOptions):
        import jax

        from workers import sharding

        self.opts = opts
        self.jax = jax
        ts_context.configure(opts.gcs_request_concurrency, opts.gcs_request_retries)
        opened = run_dir.open_run(opts.run)
        self.location, self.store = opened.location, opened.store
        self.spec, self.manifest = opened.spec, opened.manifest
        admission.check_spec(self.location, self.spec, self.manifest, opts.expect_fingerprint)
        self.topo = schedule.Topology(
            replicas=opts.replicas, replica=opts.replica,
            hosts_per_replica=jax.process_count(), host_index=jax.process_index())
        if opts.batch_size % self.topo.hosts_per_replica:
            raise ValueError(f"batch size {opts.batch_size} does not split evenly over the "
                             f"{self.topo.hosts_per_replica} hosts of the replica")
        if opts.model_parallel > jax.local_device_count():
            raise ValueError(
                f"model_parallel={opts.model_parallel} is larger than this host's "
                f"{jax.local_device_count()} devices: the hosts of a replica split the batch, "
                f"so the model axis must stay within one host")
        self.local_batch = opts.batch_size // self.topo.hosts_per_replica
        self.mesh = sharding.make_mesh(data=-1, model=opts.model_parallel)
        sharding.check_batch(opts.batch_size, self.mesh)
        self._warn_idle_hosts()
        # What differs from runner.Worker: the model, its hooks and their widths.
        self.model = flax_model.load(self.spec.model.flax, self.mesh)
        problem = flax_model.packing_problem(self.spec.packing, self.model.call,
                                             self.spec.model.flax)
        if problem:
            raise admission.RunMismatch(f"{self.location}: {problem}")
        try:
            self.capture = flax_hooks.parse_hooks(self.spec.capture.hooks, self.model.paths)
        except ValueError as e:
            raise admission.RunMismatch(f"{self.location}: capture.hooks: {e}") from e
        if self.model.vocab_size is not None and \
                self.manifest.vocab_size > self.model.vocab_size:
            raise admission.RunMismatch(
                f"tokenizer vocabulary ({self.manifest.vocab_size} ids, from "
                f"{self.spec.tokenizer.path}) is larger than the Flax model's embedding "
                f"({self.model.vocab_size} rows, {self.spec.model.flax}): tokenizer and "
                f"model do not belong together")
        admission.check_token_layout(self.store, self.location)
        self.max_context = None  # every row is seen alone (continue overflow is refused)
        self.fn = flax_step.FlaxExtractFn(self.model, self.capture, self.mesh,
                                          self.spec.capture.dtype)
        self.warmup_rows = None
        self.hooks = self.fn.hook_widths(self.manifest.seq_len)
        self.numerics = admission.numerics_key(jax, self.mesh, opts.batch_size,
                                               opts.model_parallel)
        self._committed = commit_lib.committed_partitions(self.store)
        admission.check_activation_info(self.store, self.location, self.spec, self.hooks,
                                        self.model.digest, self.numerics,
                                        opts.allow_numerics_change,
                                        nothing_committed=not self._committed)
        self.arrays = writer.ActivationArrays(
            self.location, self.hooks, self.manifest.total_rows, self.manifest.seq_len,
            self.spec.capture.dtype, self.spec.layout)
        self.tokens = prefetch.TokenStore(self.location)
        self.host = opts.host_name or (
            f"{socket.gethostname()}-r{self.topo.replica}h{self.topo.host_index}")
        self.attempt = f"{self.host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.stop_requested = threading.Event()
        self.progress = progress.Progress()
        self.transfer = transfer.HostTransfer(jax, self.fn, opts.batch_size)
        self.one_segment_per_row = self.spec.packing.mode == "concat"
