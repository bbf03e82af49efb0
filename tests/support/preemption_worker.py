"""One process of a two-process `jax.distributed` run on loopback that checkpoints each step until preempted.

    python tests/support/preemption_worker.py PROCESS_ID PORT OUT_DIR

Each step both processes sleep a little and ask the Checkpointer (orbax's preemption sync point); process 0
writes OUT_DIR/running once step 2 is done, for the test to SIGTERM one process. On preemption each process writes
OUT_DIR/saved_<PROCESS_ID> (the step it saved) and exits with RESTART_EXIT_CODE, as the trainer does.
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(process_id: int, port: int, out: str) -> int:
    from drgrpo_jax.hosts import start_distributed

    start_distributed(f"127.0.0.1:{port}", 2, process_id)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from drgrpo_jax.checkpoint import RESTART_EXIT_CODE, Checkpointer
    from drgrpo_jax.sharding import MeshShape, make_mesh, place

    mesh = make_mesh(MeshShape(data=8, fsdp=1, tensor=1))
    state = place({"w": np.arange(8.0, dtype=np.float32)}, NamedSharding(mesh, PartitionSpec("data")))
    with Checkpointer(os.path.join(out, "checkpoints"), save_every=1000, keep=2, catch_sigterm=True) as checkpointer:
        for step in range(1, 600):
            time.sleep(0.1)
            state = jax.tree.map(lambda w: w + 1, state)
            checkpointer.save(step, state, {"step": step})
            if checkpointer.preempted(step):
                with open(os.path.join(out, f"saved_{process_id}"), "w") as f:
                    f.write(str(step))
                return RESTART_EXIT_CODE
            if step == 2 and process_id == 0:
                open(os.path.join(out, "running"), "w").close()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
