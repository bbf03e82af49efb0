"""One process of a two-process `jax.distributed` run on loopback (gloo CPU collectives).

    python tests/support/multihost_worker.py PROCESS_ID PORT OUT.npz [DCN_DATA [DATA,FSDP,CONTEXT,TENSOR]]

Each process owns 4 fake CPU devices and holds every row of the window, as the trainer's processes do
(`hosts.gather_hosts`); `sharding.place` puts each process's shards on its devices. Process 0 writes the
updated parameters and metrics for the test to compare with a one-process run. DCN_DATA=2: the two processes
stand in for two slices (CPU devices all report slice 0: sharding.device_grid takes each process as one),
mesh.data's two ways crossing between them. The mesh is data=2, fsdp=2, tensor=2 unless the last argument names
another, e.g. 1,1,4,2: context's four ways cross the processes.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `support`

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_default_matmul_precision", "highest")


def main(process_id: int, port: int, out: str, dcn_data: int = 1, mesh_sizes: str = "2,2,1,2") -> None:
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=120)
    import dataclasses

    import numpy as np
    import optax
    from flax import nnx
    from jax.experimental import multihost_utils

    from drgrpo_jax.losses import LossConfig
    from drgrpo_jax.models.transformer import Transformer
    from drgrpo_jax.sharding import MeshShape, batch_sharding, make_mesh, param_shardings, place
    from drgrpo_jax.step.config import StepConfig
    from drgrpo_jax.step.train_step import init_state, jit_policy_logprobs, jit_train_step, state_shardings

    from support.tiny_models import tiny_decoder_config
    from support.tiny_step import STEP_RESPONSE, make_step_batch

    assert jax.process_count() == 2 and jax.device_count() == 8
    data, fsdp, context, tensor = map(int, mesh_sizes.split(","))
    mesh = make_mesh(MeshShape(data=data, fsdp=fsdp, context=context, tensor=tensor), dcn_data=dcn_data)
    if context > 1:  # the split's all-gathers cross the processes
        assert {d.process_index for d in mesh.devices[0, 0, :, 0]} == {0, 1}
    if dcn_data == 2:  # each data way is one process's (slice's) devices
        assert [{d.process_index for d in mesh.devices[i].flat} for i in range(2)] == [{0}, {1}]
    model = Transformer(tiny_decoder_config(), rngs=nnx.Rngs(0))  # identical on every process; placed below
    optimizer = optax.sgd(0.5)
    config = StepConfig(loss=LossConfig(budget=STEP_RESPONSE), micro_batches=2, logprob_chunk=5)
    graphdef, state = init_state(model, optimizer, jax.random.key(0))
    params_shardings = param_shardings(state.params, mesh)
    shardings = state_shardings(state, params_shardings, mesh)
    state = place(state, shardings)
    step = jit_train_step(graphdef, optimizer, optax.constant_schedule(0.5), config, shardings, mesh)
    batch = place(make_step_batch(), batch_sharding(mesh))
    old = jit_policy_logprobs(graphdef, config, params_shardings, mesh)(state.params, batch)
    batch = dataclasses.replace(batch, old_logprobs=old, behaviour_logprobs=old)
    state, metrics = step(state, batch)
    params = multihost_utils.process_allgather(state.params, tiled=True)
    if process_id == 0:
        leaves = {f"param_{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(params))}
        np.savez(out, **leaves, **{f"metric_{k}": np.asarray(v) for k, v in jax.device_get(metrics).row().items()})
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], *(int(a) if a.isdigit() else a for a in sys.argv[4:]))
