"""The token arrays' chunk checksums (since 0.3.0), and what a reader does about them.

Each stored inner chunk of a token array ends with the crc32c of its (compressed) bytes,
zarr v3's `crc32c` codec: a changed byte fails the read (tensorstore's DATA_LOSS, "Digest
mismatch") where before it could decode into other tokens that nothing noticed, as the
token arrays have no other checksum. Such an array is also written with every chunk
stored, a chunk of fill values too (by default tensorstore stores none of those): a chunk
missing from it (an object deleted, or left out of a copy of the run) is lost data, so it
is read as an error (NOT_FOUND), not as the fill value (token id 0; segment id 0, which
reads as padding). schemas.ts_context opens every array whose metadata has the codec so.

Token arrays written before have neither and read as they are; prepare writes into them
in their own format (schemas.layout.ArrayLayout.specs). Activation blocks are checksummed
in their commit markers (`actx verify`) and their chunks stay as they were: the reader
copies a local uncompressed hook's chunks straight from the page cache
(reader.storage.shard_files).
"""

from __future__ import annotations

CODEC = {"name": "crc32c"}
WRITE_EVERY_CHUNK = {"store_data_equal_to_fill_value": True}
READ_NO_MISSING_CHUNK = {"fill_missing_data_reads": False}


# tensorstore's words for a stored chunk that cannot be read as written: undecodable
# (truncated, overwritten), failing its checksum, or missing from an array that stores
# every chunk.
_DAMAGE_WORDS = ("FAILED_PRECONDITION", "DATA_LOSS", "Error decoding", "Error reading shard",
                 "is missing")


def is_damage(error: BaseException) -> bool:
    """Whether a read's error says a stored chunk is damaged or lost (not a store's
    refusal, which schemas.store_errors names)."""
    return any(words in str(error) for words in _DAMAGE_WORDS)


def in_metadata(metadata: dict) -> bool:
    """Whether an array's zarr v3 metadata (as tensorstore reports it) ends its inner
    chunks with CODEC: written by this release's prepare, every chunk stored."""
    return any(CODEC in (codec.get("configuration") or {}).get("codecs", [])
               for codec in metadata.get("codecs", []))
