"""A generating run (run.json's `generate`): `generator` (batched, continuous generation
over per-slot caches), `step` (one generating step), `sampling`, `config` (what it
generates), `text` (what it needs of the tokenizer) and `worker` (a partition's samples
into its rows)."""
