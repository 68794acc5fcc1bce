"""actx schemas."""
