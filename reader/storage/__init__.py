"""How the reader gets stored bytes: `read_contexts` (the tensorstore contexts arrays are
opened in), `read_window` (at most `in_flight` block reads at once), `shard_files` (where a
token lies in an uncompressed shard file), `mapped_region` and `mapped_hook` (shard files
mapped side by side and copied from the page cache) and `row_copy` (the native row copy,
checked against numpy, with numpy's as the fallback)."""
