"""The submit config: a run spec plus where and how to run it, from one YAML/TOML file.

Built with `schemas.config`, so an unknown key or a wrong type is an error naming the
dotted key and the file. `--set key.sub=value` overrides apply before validation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import shutil
import tempfile
from typing import Literal

from actx.deploy import targets as targets_lib
from actx.deploy.targets.slurm.settings import SlurmConfig
from actx.schemas import config as config_lib
from actx.schemas import parallelism
from actx.schemas import runspec as runspec_lib
from actx.schemas import spec_paths
from actx.schemas import worker_options

# The directory that holds the actx package this process runs: a checkout's root (actx/
# beside schemas/, ...) or site-packages (actx is this module's parent: already imported).
CODE_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(
    importlib.util.find_spec("actx").origin)))
# Shipped inside the package so `actx submit` works from any install, not only a clone.
DEMO_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo.yaml")
CACHE_PLACEHOLDER = "{cache}"
# target.kind takes the registered targets' names (deploy.targets.KINDS), and only those.
TargetKind = Literal[targets_lib.NAMES]


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    """A Cloud TPU VM slice driven through `gcloud compute tpus`.

    name / zone / project: the TPU VM (or queued resource node) and where it lives.
    accelerator_type: e.g. "v4-32", "v5litepod-16", "v6e-8".
    runtime_version: TPU VM software version (image).
    create: create the slice first (tpu-vm create, or a queued resource when
      `queued_resource`); false: the slice already exists.
    queued_resource: create through `gcloud compute tpus queued-resources create`.
    spot: ask for spot capacity when creating.
    hosts: TPU VM hosts in the slice (0: derived from accelerator_type).
    coordinator_port: port of jax.distributed's coordinator on worker 0.
    install: pip requirement installed on every host ("": a wheel of the actx that runs
      `actx submit`, a checkout or a pip install, built in a temporary directory and copied
      with `tpu-vm scp`).
    jax_requirement: installed beside actx on every host ("": none).
    python: the interpreter on the hosts.
    env: extra environment variables for the worker processes.
    poll_s: seconds between queued-resource state queries.
    wait_timeout_s: the wait for a queued resource to become ACTIVE fails after this long.
    log_every_s: seconds between copies of a host's log into <run>/logs/<job>/ (>= 1).
    """

    name: str = ""
    zone: str = ""
    project: str = ""
    accelerator_type: str = "v4-8"
    runtime_version: str = "tpu-ubuntu2204-base"
    create: bool = False
    queued_resource: bool = False
    spot: bool = False
    hosts: int = 0
    coordinator_port: int = 8476
    install: str = ""
    jax_requirement: str = "jax[tpu]"
    python: str = "python3"
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    poll_s: float = 30.0
    wait_timeout_s: float = 3600.0
    log_every_s: float = 10.0


@dataclasses.dataclass(frozen=True)
class DataflowConfig:
    """Prepare on Google Cloud Dataflow (standard Beam PipelineOptions).

    temp_location: a gs:// prefix for Dataflow's temporary files (required).
    staging_location: where the job's packages are staged (default: temp_location/staging).
    job_name: Dataflow job name (default: actx-prepare-<run name>-<fingerprint>).
    setup_file: the setup.py staged to the Dataflow workers ("": this checkout's).
    extra_args: more PipelineOptions flags, passed through unchanged.
    sdk_container_image: the worker image for extraction on Dataflow (`target.extract:
      beam`), built from deploy/containers/Dockerfile.gpu or Dockerfile.tpu.
    extract_accelerator: Dataflow's worker_accelerator for extraction, e.g.
      "type:nvidia-l4;count:1;install-nvidia-driver" or "type:tpu-v5-lite-podslice;topology:1x1".
    extract_machine_type: the workers' machine type for extraction (e.g. g2-standard-8,
      ct5lp-hightpu-1t).
    """

    project: str = ""
    region: str = ""
    temp_location: str = ""
    staging_location: str = ""
    job_name: str = ""
    setup_file: str = ""
    max_num_workers: int = 0
    machine_type: str = ""
    service_account_email: str = ""
    subnetwork: str = ""
    extra_args: tuple[str, ...] = ()
    sdk_container_image: str = ""
    extract_accelerator: str = ""
    extract_machine_type: str = ""


@dataclasses.dataclass(frozen=True)
class TargetConfig(worker_options.ExtractSettings):
    """Where prepare and extract run, and how the workers extract.

    kind: "local" (this machine: in-process Beam, then `hosts` worker processes as
      simulated hosts), "tpu-vm" (a TPU VM slice through gcloud), "dataflow" (prepare
      on Dataflow only; extract afterwards with `actx rerun --config` on another target)
      or "slurm" (a Slurm cluster: an sbatch array, the `slurm` table).
    prepare: where prepare runs for kinds "tpu-vm" and "slurm": "local" (in-process Beam
      writing to the run URI) or "dataflow" (the `dataflow` table).
    hosts: local worker processes (simulated hosts); replicas = hosts / hosts_per_replica.
    hosts_per_replica: local processes that form one replica (joined by jax.distributed
      on loopback).
    devices_per_host: simulated XLA CPU devices per local process (set in its XLA_FLAGS;
      the other XLA flags you set there pass through to it).
    steal: replicas take other replicas' uncommitted partitions when done with their own
      (on by default for a job; a worker process started alone does not steal).
    extract: "workers" (worker processes that actx starts: local processes or the TPU
      slice's hosts) or "beam" (the ExtractPartitions transform on a Beam runner: locally
      with `beam_args`, or on Dataflow GPU/TPU workers for kind "dataflow").
    beam_args: Beam flags for local extraction through Beam (default the in-process
      FnApiRunner; e.g. --direct_num_workers=2 --direct_running_mode=multi_processing), or
      extra flags for Dataflow.
    Every other field is an `ExtractSettings` field (batch_size, model_parallel,
    heartbeat_s, ...), documented there and passed to each worker as its flag.
    """

    kind: TargetKind = "local"
    prepare: Literal["local", "dataflow"] = "local"
    hosts: int = 1
    hosts_per_replica: int = 1
    devices_per_host: int = 1
    steal: bool = True
    extract: Literal["workers", "beam"] = "workers"
    beam_args: tuple[str, ...] = ()
    tpu: TpuConfig = TpuConfig()
    dataflow: DataflowConfig = DataflowConfig()
    slurm: SlurmConfig = SlurmConfig()

    def __post_init__(self):
        super().__post_init__()
        if self.hosts < 1 or self.hosts_per_replica < 1:
            raise ValueError("hosts and hosts_per_replica must be >= 1")
        if self.hosts % self.hosts_per_replica:
            raise ValueError(f"hosts ({self.hosts}) must be a multiple of hosts_per_replica "
                             f"({self.hosts_per_replica})")
        split = parallelism.hosts_problem(self.batch_size, self.hosts_per_replica)
        if split:
            raise ValueError(f"batch_size: {split}")

    @property
    def replicas(self) -> int:
        return self.hosts // self.hosts_per_replica


@dataclasses.dataclass(frozen=True)
class ExtractionConfig:
    """One named extraction of the run's token store (schemas.extraction).

    model: its model (the spec's tokenizer must be this model's too).
    capture: its hooks and dtype (default: the spec's capture).
    """

    model: runspec_lib.ModelSpec
    capture: runspec_lib.CaptureConfig | None = None


@dataclasses.dataclass(frozen=True)
class StoragePrices:
    """Prices `actx submit --dry-run --estimate` charges for the bucket, in US dollars. The
    defaults are GCS list prices (Standard storage in one region, e.g. us-central1); set
    yours (a discount, another storage class or location) and name them in `source`.

    class_a_per_10k: dollars per 10,000 Class A operations (object writes, listings).
    class_b_per_10k: dollars per 10,000 Class B operations (object reads).
    storage_per_gib_month: dollars per GiB stored for a month.
    source: where these prices come from, printed beside every dollar figure.
    """

    class_a_per_10k: float = 0.05
    class_b_per_10k: float = 0.004
    storage_per_gib_month: float = 0.020
    # Checked 2026-12 against cloud.google.com/storage/pricing-examples: Class A (object
    # adds, bucket and object listings) $0.005 and Class B (object gets) $0.0004 per 1,000,
    # Standard storage in us-east1 $0.020 per GB-month. A multi-region bucket costs more.
    source: str = ("GCS list prices, Standard storage in a region, "
                   "cloud.google.com/storage/pricing as of 2026-12")


@dataclasses.dataclass(frozen=True)
class SubmitConfig:
    """run: the run directory (local path or gs://bucket/path).
    spec: the run spec (model, tokenizer, sources, packing, capture, layout, name).
    target: where it runs.
    demo_assets: make the demo's inputs in the cache first (the embedded demo config).
    max_reject_fraction: prepare fails when more inputs than this are rejected.
    extractions: named extractions over the one token store, e.g. `base` and `chat` for a
      crosscoder (README, "Several models on one token store"): when given, the workers
      extract these, one after another, instead of the spec's own model (which then only
      serves prepare's tokenizer check).
    prices: what `--dry-run --estimate` charges for the bucket's requests and storage.
    """

    run: str
    spec: runspec_lib.RunSpec
    target: TargetConfig = TargetConfig()
    demo_assets: bool = False
    max_reject_fraction: float = 0.01
    extractions: dict[str, ExtractionConfig] = dataclasses.field(default_factory=dict)
    prices: StoragePrices = StoragePrices()

    def __post_init__(self):
        from actx.schemas import layout

        for name in self.extractions:
            layout.check_extraction_name(name)

    def extraction_specs(self) -> dict[str, runspec_lib.RunSpec]:
        """The RunSpec of each named extraction: the spec with its model and capture."""
        from actx.schemas import extraction

        return {name: extraction.spec_for(self.spec, e.model, e.capture or self.spec.capture)
                for name, e in self.extractions.items()}


def _expand(value, cache: str):
    if isinstance(value, str):
        return value.replace(CACHE_PLACEHOLDER, cache)
    if isinstance(value, list):
        return [_expand(v, cache) for v in value]
    if isinstance(value, dict):
        return {k: _expand(v, cache) for k, v in value.items()}
    return value


def load_submit_config(path: str | None, overrides: list[str] = (),
                       check_old_run: bool = True) -> SubmitConfig:
    """Loads a submit config (None: the embedded demo config) with `--set` overrides.

    Strings may name "{cache}" (the actx cache directory). Relative local paths of the
    spec (sources, model, tokenizer) and `run` (also when given by `--set`) are taken from
    the config file's directory; the embedded demo's `run` (runs/demo) from the current
    directory, where its README walk-through looks. `check_old_run`: refuse a `run` that
    the old rule (up to actx 0.2.0: the current directory) found prepared and the
    new one does not (`old_run_problem`). Raises ConfigError naming the key and the file.
    """
    from actx.deploy import demo

    demo_config = path is None
    path = path or DEMO_CONFIG
    data = config_lib.load_file(path)
    data = config_lib.apply_overrides(data, list(overrides))
    data = _expand(data, demo.cache_dir())
    base_dir = os.path.dirname(os.path.abspath(path))
    if isinstance(data.get("spec"), dict):
        data["spec"] = spec_paths.absolute_paths(data["spec"], base_dir)
    for name, extraction in (data.get("extractions") or {}).items():
        if isinstance(extraction, dict) and isinstance(extraction.get("model"), dict):
            model = spec_paths.absolute_paths({"model": extraction["model"]}, base_dir)
            data["extractions"][name] = {**extraction, "model": model["model"]}
    written = data.get("run")
    if isinstance(written, str) and not demo_config:
        data["run"] = run_location(written, base_dir)
    cfg = config_lib.from_dict(SubmitConfig, data, f"{path}: ")
    if check_old_run and isinstance(written, str) and not demo_config:
        problem = old_run_problem(written, cfg.run, cfg.spec.fingerprint)
        if problem:
            raise config_lib.ConfigError(f"{path}: run: {problem}")
    return cfg


def run_location(run: str, base_dir: str) -> str:
    """A config's `run` as a location: gs:// and memory:// as written, a local path taken
    from the config file's directory (`base_dir`) like every other path of the config."""
    if "://" in run or os.path.isabs(run):
        return run
    return os.path.normpath(os.path.join(base_dir, os.path.expanduser(run)))


def old_run_problem(written: str, run: str, fingerprint: str) -> str:
    """Why a relative `run` must not be used as resolved ("": it may).

    Up to actx 0.2.0 a config's `run` was taken from the current directory. A run made that
    way, submitted again from that directory, would now resolve elsewhere and be prepared
    again from scratch, quietly, beside the old one. So when `run` (from the config's
    directory) does not exist while the same words from the current directory name
    a run prepared for this very spec (its fingerprint), nothing is done and both paths
    are named: the user says which one is meant (refusing costs one edit; guessing could
    write a second copy of a large run, or later point at the wrong one)."""
    old = os.path.abspath(os.path.expanduser(written))
    if "://" in written or os.path.isabs(written) or old == run:
        return ""
    if os.path.exists(run) or _prepared_fingerprint(old) != fingerprint:
        return ""
    return (f"{written!r} is taken from the config file's directory (after actx 0.2.0): "
            f"{run}, which does not exist; {old} (from the current directory, the old "
            f"rule) holds this config's run (fingerprint {fingerprint}). Nothing was done. "
            f"To go on with it, write `run: {old}` in the config (or pass --run {old}); to "
            f"start a new run at {run}, create that directory first")


def _prepared_fingerprint(path: str) -> str | None:
    """The fingerprint in `path`/run.json of a local run directory (None: none there)."""
    import json

    try:
        with open(os.path.join(path, runspec_lib.RUN_SPEC_KEY)) as f:
            return json.load(f).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def target_from_flags(base: TargetConfig, **flags) -> TargetConfig:
    """`base` with the command-line flags that were given (None: keep the config's)."""
    changes = {k: v for k, v in flags.items() if v is not None}
    return dataclasses.replace(base, **changes) if changes else base


def code_path() -> str:
    """The directory local workers start in and find first on their path, so that they
    import the actx this process runs and nothing of it under another name.

    An installed actx: site-packages, where it is. A source checkout: a directory in the
    temporary directory holding only a link to the checkout's actx/ (the front door finds
    the subpackages from there): the checkout's root itself would make schemas, reader,
    pipeline, ... importable at the top level, where PyPI's packages of those names belong.
    """
    if not os.path.isfile(os.path.join(CODE_ROOT, "setup.py")):
        return CODE_ROOT
    front = os.path.join(CODE_ROOT, "actx")
    digest = hashlib.sha256(front.encode()).hexdigest()[:12]
    path = os.path.join(tempfile.gettempdir(), f"actx-code-{digest}")
    link = os.path.join(path, "actx")
    for _ in range(2):
        if os.path.islink(link) and os.path.realpath(link) == os.path.realpath(front):
            return path
        shutil.rmtree(path, ignore_errors=True)  # not what it should be: made again
        tmp = tempfile.mkdtemp(prefix=".actx-code-", dir=tempfile.gettempdir())
        os.chmod(tmp, 0o755)
        os.symlink(front, os.path.join(tmp, "actx"))
        try:
            os.rename(tmp, path)
        except OSError:  # another launcher made it first
            shutil.rmtree(tmp, ignore_errors=True)
    raise RuntimeError(f"could not make {path} a link to {front}; check the temporary "
                       f"directory's permissions (TMPDIR)")
