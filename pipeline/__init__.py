"""actx pipeline."""
