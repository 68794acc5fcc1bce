"""Attention on each backend: `dispatch` (the masks that define what each token sees, and
the implementation each backend runs), `key_ranges` (one key interval per query), the
kernels (`xla`, `ranged_flash_gpu`, `ranged_flash_tpu`, `decode_flash` for generating
steps) and `kv_cache` (the per-slot cache that carries a long document's context)."""
