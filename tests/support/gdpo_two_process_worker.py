"""One process of a two-process `jax.distributed` GDPO run on loopback (gloo CPU collectives).

    python tests/support/gdpo_two_process_worker.py PROCESS_ID PORT OUT.npz

Each process owns 4 fake CPU devices and feeds only its own half of the batch's groups; the
advantages are computed over the 8-device mesh with the whitening statistics psum-reduced
across both processes, and process 0 writes the gathered result for the test to compare.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `support`

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(process_id: int, port: int, out: str) -> None:
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=120)
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from drgrpo_jax import advantages

    from support.gdpo_batches import GDPO_WEIGHTS, eight_group_batch

    components, valid = eight_group_batch()
    mine = slice(4 * process_id, 4 * process_id + 4)  # this host's groups only
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices())
    rows = NamedSharding(mesh, P("data"))
    local = [jax.make_array_from_process_local_data(rows, x[mine], x.shape) for x in (components, valid)]
    fn = jax.jit(jax.shard_map(lambda c, v: advantages.gdpo(c, jnp.asarray(GDPO_WEIGHTS), v, axis_name="data"),
                               mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data")))
    result = multihost_utils.process_allgather(fn(*local), tiled=True)
    if process_id == 0:
        np.savez(out, advantages=result)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
