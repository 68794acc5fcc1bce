"""actx deploy."""
