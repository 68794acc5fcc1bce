"""The streaming two-level shuffle (`run.stream`): `stream` (ShuffledStream: its settings
and iteration), `blocks` (its plan: row blocks, their process, buffers per epoch),
`pipeline` (one pass: buffers loaded ahead, cut into batches, copied, handed over),
`buffers` (one buffer's reads, order and copies), `gather` (each token's one copy into its
batch), `array_pool` (batch arrays reused), `state` (where a stream stands, to resume it)
and `mixing` (how well mixed its batches are). The bytes come through `reader.storage`."""
