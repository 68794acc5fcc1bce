"""actx workers."""
