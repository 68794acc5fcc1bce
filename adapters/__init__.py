"""Adapters between engines: the only modules that import both Apache Beam and JAX."""
