"""actx reader: random access and shuffled batches of stored activations."""
