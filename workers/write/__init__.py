"""What a host writes: `writer` (whole zarr shards, off the critical path), `block_copy`
(a step's rows into the writer's blocks) and `commit` (every host's shards durable, then
the partition's marker)."""
