"""The decoder as data and pure functions: `config` (ModelConfig), `families` (each family
as data, and the reader of an HF config.json), `checkpoint` and `checkpoint_check`
(safetensors in, and checked before any work), `decoder` (the forward), `rope`, `moe`,
`capture` (which activations a step keeps), `step` (the jitted step), `sharding` (logical
axes onto the mesh), `loaded` (a loaded model as one value)."""
