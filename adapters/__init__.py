"""Adapters between engines: the only modules that import both Apache Beam and JAX."""

from actx import pipeline  # noqa: F401  (imports Beam quietly first: see pipeline/__init__.py)
