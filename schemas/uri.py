"""Locations of runs and inputs: gs://bucket/path, memory://name, or a local path.

Every stage addresses storage through a tensorstore kvstore spec, so one URI form works
for the token store, the activation arrays and the small JSON objects of a run.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Location:
    """A parsed storage location.

    scheme: "file", "gs" or "memory".
    bucket: GCS bucket ("" for other schemes).
    path: path inside the bucket, the absolute local path, or the memory prefix; never
      ends with "/" (the empty string is the root).
    """

    scheme: str
    bucket: str
    path: str

    def join(self, *parts: str) -> "Location":
        pieces = [self.path] if self.path else []
        pieces += [p.strip("/") for p in parts if p.strip("/")]
        joined = "/".join(pieces)
        if self.scheme == "file" and not joined.startswith("/"):
            joined = "/" + joined
        return Location(self.scheme, self.bucket, joined)

    def __str__(self) -> str:
        if self.scheme == "gs":
            return f"gs://{self.bucket}/{self.path}" if self.path else f"gs://{self.bucket}"
        if self.scheme == "memory":
            return f"memory://{self.path}"
        return self.path

    def kvstore(self, directory: bool = True) -> dict:
        """The tensorstore kvstore spec of this location (a directory when `directory`)."""
        suffix = "/" if directory and self.path else ""
        if self.scheme == "gs":
            return {"driver": "gcs", "bucket": self.bucket, "path": self.path + suffix}
        if self.scheme == "memory":
            return {"driver": "memory", "path": self.path + suffix}
        return {"driver": "file", "path": self.path + ("/" if directory else "")}

    @property
    def is_local(self) -> bool:
        return self.scheme == "file"


def parse(uri: "str | os.PathLike | Location") -> Location:
    """Parses gs://bucket/path, memory://path, file:///path or a local path."""
    if isinstance(uri, Location):
        return uri
    text = os.fspath(uri)
    if text.startswith("gs://"):
        rest = text[len("gs://"):]
        bucket, _, path = rest.partition("/")
        if not bucket:
            raise ValueError(f"{text!r}: a gs:// URI needs a bucket name (gs://BUCKET/path)")
        return Location("gs", bucket, path.strip("/"))
    if text.startswith("memory://"):
        return Location("memory", "", text[len("memory://"):].strip("/"))
    if text.startswith("file://"):
        text = text[len("file://"):]
    if "://" in text:
        raise ValueError(
            f"{text!r}: unsupported URI scheme; use gs://bucket/path, memory://name or a local path")
    path = os.path.abspath(os.path.expanduser(text))
    return Location("file", "", path.rstrip("/") or "/")
