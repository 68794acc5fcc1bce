"""README's own-data recipe works with the demo's model as written (issue 66, item 5): the
demo's model directory carries its tokenizer (the same files as the demo's tokenizer
directory), so the recipe's config, with `models/my-model` the demo's model, passes
`actx submit`'s pre-flight (a dry run) with `tokenizer:` the model directory."""

from __future__ import annotations

import filecmp
import io
import os
import shutil

from actx.deploy import cli, demo
from tests.test_readme import README, blocks, section


def test_the_demo_model_carries_its_tokenizer_and_the_recipe_takes_it(tmp_path, monkeypatch):
    root = demo.ensure_demo_assets(str(tmp_path / "cache"))
    model = os.path.join(root, "demo", "qwen2-tiny-random")
    tokenizer = os.path.join(root, "qwen2-tokenizer")
    names = sorted(n for n in os.listdir(tokenizer)
                   if os.path.isfile(os.path.join(tokenizer, n)))
    assert "tokenizer.json" in names
    match, mismatch, errors = filecmp.cmpfiles(tokenizer, model, names, shallow=False)
    assert match == names and not mismatch and not errors
    # Made again over a cache from before (a model directory without them): added.
    os.remove(os.path.join(model, "tokenizer.json"))
    demo.ensure_demo_assets(root)
    assert filecmp.cmp(os.path.join(tokenizer, "tokenizer.json"),
                       os.path.join(model, "tokenizer.json"), shallow=False)

    [config] = blocks(section(README, "## Your own data in five minutes"), "yaml")
    assert "tokenizer: {path: models/my-model}" in config
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-run.yaml").write_text(config)
    shutil.copytree(model, tmp_path / "models" / "my-model")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.jsonl").write_text('{"id": "n1", "body": "Dear diary"}\n')
    out = io.StringIO()
    assert cli.main(["submit", "my-run.yaml", "--dry-run"], out=out) == 0, out.getvalue()
    assert "tokenizer not found" not in out.getvalue()
