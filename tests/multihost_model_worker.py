"""One process of the multi-host extraction test (run by tests/test_multihost_model.py).

Joins `jax.distributed` on 127.0.0.1, builds one mesh over both processes' CPU devices,
feeds this process's rows with `make_array_from_process_local_data`, and saves the rows
of every hook this process holds to <out_dir>/<mesh>.p<process_id>.npz.

Usage: python -m tests.multihost_model_worker PROCESS_ID NUM_PROCESSES PORT CKPT INPUTS OUT_DIR
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> None:
    process_id, num_processes, port = int(argv[0]), int(argv[1]), int(argv[2])
    ckpt, inputs_path, out_dir = argv[3:6]

    import jax
    import numpy as np

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=num_processes, process_id=process_id)
    from actx.workers.model import capture, sharding, step
    from actx.workers.model import decoder as model_lib

    inputs = np.load(inputs_path)
    hooks = str(inputs["hooks"])
    global_batch, seq = inputs["input_ids"].shape
    for data, model_size in ((2, 2), (4, 1)):
        mesh = sharding.make_mesh(data=data, model=model_size)
        model = model_lib.load_pretrained(ckpt, mesh=mesh)
        fn = step.make_extract_fn(model, capture.CaptureSpec.parse(hooks))
        token_sharding = sharding.data_parallel_sharding(mesh, 2)
        # This process's rows: the batch slices of the data shards its devices hold.
        rows = sorted({index[0].start or 0 for index in
                       token_sharding.addressable_devices_indices_map(
                           (global_batch, seq)).values()})
        per_shard = global_batch // data
        local_rows = np.concatenate([np.arange(r, r + per_shard) for r in rows])
        assert (np.diff(local_rows) == 1).all(), "process rows must be contiguous"

        def global_array(name):
            return jax.make_array_from_process_local_data(
                token_sharding, inputs[name][local_rows], (global_batch, seq))

        out = fn(global_array("input_ids"), global_array("positions"),
                 global_array("segment_ids"))
        saved = {"rows": local_rows}
        for name, array in out.items():
            local = np.zeros((len(local_rows), seq, array.shape[-1]), np.float32)
            for shard in array.addressable_shards:
                start = shard.index[0].start or 0
                local[start - local_rows[0]:start - local_rows[0] + shard.data.shape[0]] = \
                    np.asarray(shard.data)
            saved[name] = local
        np.savez(os.path.join(out_dir, f"{data}x{model_size}.p{process_id}.npz"), **saved)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
