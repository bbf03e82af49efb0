"""Shared test inputs: the tiny random model, prompt files, trainer runs, the step's tiny batch, GDPO's batch.

Plain functions and constants, importable by test modules, conftest fixtures and the worker
scripts the tests start (tests/ is on their path). Test modules import from here, never from
one another.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")

# ---------------------------------------------------------------------------------------------
# The tiny random Llama (transformers, saved offline) with a character-level tokenizer
# ---------------------------------------------------------------------------------------------

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?+-=*/()ABCDEFGHIJKLMNOPQRSTU"
TINY_VOCAB = 3 + 48  # <unk>, <s>, </s>, then lowercase, digits, space and punctuation


def write_tiny_llama(path: str, seed: int = 0, *, vocab_size: int = TINY_VOCAB, hidden_size: int = 32,
                     initializer_range: float = 0.3, max_position_embeddings: int = 128) -> str:
    """A random 2-layer Llama saved by transformers, with a character-level tokenizer of the first
    vocab_size - 3 characters of CHARS; <s> = 1, </s> = 2 (EOS). A larger initializer_range gives
    peaked, seed-dependent continuations."""
    import torch
    import transformers

    from char_tokenizer import save_char_tokenizer

    vocab = save_char_tokenizer(path, CHARS[:vocab_size - 3])
    assert len(vocab) == vocab_size, (len(vocab), vocab_size)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, initializer_range=initializer_range)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def write_prompts(path: str, num: int) -> str:
    """Short arithmetic questions as JSONL (question/answer fields)."""
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(num):
            a, b = (int(x) for x in rng.integers(0, 10, 2))
            f.write(json.dumps({"question": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# The trainer CLI on the tiny model (python -m drgrpo_jax.train as a child process)
# ---------------------------------------------------------------------------------------------


def has_letter_a(completion: str, example) -> float:
    """A test reward (`helpers:has_letter_a`) a random model earns on some completions and misses on others."""
    return 1.0 if "a" in completion else 0.0


def trainer_overrides(model: str, prompts: str, output_dir, steps: int) -> list[str]:
    """A 2-way data-parallel run: 4 prompts x 4 samples, 2 minibatches, eval and a checkpoint every 2 steps."""
    return [f"run.output_dir={output_dir}", "run.sample_every=2", f"model.path={model}",
            "data.source=jsonl", f"data.path={prompts}", "data.template='{question}'", "data.size=0",
            "data.eval_size=4", "rollout.group_size=4", "rollout.prompts_per_step=4", "rollout.max_new_tokens=12",
            "rollout.max_prompt_tokens=16", "algorithm.minibatches_per_rollout=2",
            "reward.functions=[helpers:has_letter_a,format]", "reward.num_workers=1",
            "optimizer.learning_rate=0.01", f"train.steps={steps}", "train.eval_every=2", "train.save_every=2",
            "mesh.data=2"]


def trainer_env() -> dict[str, str]:
    """The environment of a trainer child: tests/ importable (reward functions), 2 fake CPU devices, offline."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, TESTS]), "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "HF_HUB_OFFLINE": "1"}


def start_trainer(overrides: list[str], **env: str) -> subprocess.Popen:
    """`python -m drgrpo_jax.train OVERRIDES...` with stdout and stderr piped (extra environment variables: env)."""
    return subprocess.Popen([sys.executable, "-m", "drgrpo_jax.train", *overrides], cwd=REPO,
                            env={**trainer_env(), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ---------------------------------------------------------------------------------------------
# The training step's tiny model and window (tests/step/test_train_step.py, tests/multihost_worker.py)
# ---------------------------------------------------------------------------------------------

STEP_ROWS, STEP_PROMPT, STEP_RESPONSE = 16, 6, 12



def kill_and_resume(overrides: list[str], output_dir, checkpoint: int, timeout: float) -> tuple[int, int]:
    """Runs the trainer, SIGKILLs it once checkpoint `checkpoint` exists in `output_dir`, then runs it again to the
    end (it resumes from that checkpoint); fails when the first run ends before the kill or the second fails.
    Returns the two processes' pids."""
    import pathlib
    import signal
    import time

    process = start_trainer(overrides)
    while not (pathlib.Path(output_dir) / "checkpoints" / str(checkpoint)).exists() and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    resumed = start_trainer(overrides)
    _, stderr = resumed.communicate(timeout=timeout)
    assert resumed.returncode == 0, stderr[-3000:]
    return process.pid, resumed.pid


def tiny_decoder_config():
    """The step tests' 2-layer Llama-shaped DecoderConfig (vocab 64)."""
    from drgrpo_jax.models.config import DecoderConfig

    return DecoderConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)


def make_step_batch(seed=0, lengths=None):
    """A window of responses of very different lengths, long ones packed onto the first shards."""
    from drgrpo_jax.step.batch import Batch

    rows, prompt, response = STEP_ROWS, STEP_PROMPT, STEP_RESPONSE
    rng = np.random.default_rng(seed)
    prompt_lengths = rng.integers(1, prompt + 1, rows)
    prompt_mask = np.arange(prompt)[None, :] >= prompt - prompt_lengths[:, None]  # left-padded
    if lengths is None:
        lengths = np.array([12, 12, 11, 12, 10, 12, 9, 12, 1, 2, 0, 3, 1, 1, 2, 0])
    response_mask = np.arange(response)[None, :] < lengths[:, None]
    row_valid = np.ones(rows, bool)
    row_valid[-1] = False  # a padding row
    return Batch(
        prompt_ids=np.where(prompt_mask, rng.integers(0, 64, (rows, prompt)), 0).astype(np.int32),
        prompt_mask=prompt_mask,
        response_ids=np.where(response_mask, rng.integers(0, 64, (rows, response)), 0).astype(np.int32),
        response_mask=response_mask,
        advantages=rng.normal(size=rows).astype(np.float32),
        old_logprobs=np.zeros((rows, response), np.float32),  # filled by the policy before the step
        behaviour_logprobs=np.zeros((rows, response), np.float32),
        row_valid=row_valid,
    )


# ---------------------------------------------------------------------------------------------
# The sharded training step on the tiny model (tests/step/test_train_step.py, tests/step/test_packing.py)
# ---------------------------------------------------------------------------------------------

COMPILES: list[str] = []  # one entry per program XLA compiled or took from the persistent cache (conftest)


def _count_compiles() -> None:
    """Registers the COMPILES listeners once per process."""
    import jax

    if getattr(_count_compiles, "registered", False):
        return
    _count_compiles.registered = True  # type: ignore[attr-defined]
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_, **__: COMPILES.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)
    jax.monitoring.register_event_listener(
        lambda name, **_: COMPILES.append(name) if name == "/jax/compilation_cache/cache_hits" else None)


@functools.cache
def initial_old_logprobs(lengths: tuple[int, ...] | None) -> np.ndarray:
    """The initial policy's log-probs of a batch, computed once on one device and shared by every run."""
    import jax
    from flax import nnx

    from drgrpo_jax.losses import LossConfig
    from drgrpo_jax.models.transformer import Transformer
    from drgrpo_jax.step.batch import policy_logprobs
    from drgrpo_jax.step.config import StepConfig

    graphdef, params = nnx.split(Transformer(tiny_decoder_config(), rngs=nnx.Rngs(0)), nnx.Param)
    config = StepConfig(loss=LossConfig(budget=STEP_RESPONSE), logprob_chunk=5)
    batch = make_step_batch(lengths=None if lengths is None else np.array(lengths))
    return np.asarray(jax.jit(functools.partial(policy_logprobs, graphdef, config))(params, batch))


_STEP_FUNCTIONS: dict = {}  # run_step's (mesh, optimizer, shardings, step, old log-probs) per configuration


def run_step(mesh_shape, micro_batches, aggregation="fixed_budget", lengths=None, steps=1, kl_coef=0.0,
             optimizer=None, tis_cap=None, behaviour_shift=0.0, on_policy=False, loss_options=(), remat="none",
             **step_options):
    """Params and metrics after `steps` steps of the tiny model (under `remat`) on a (data, fsdp, tensor) mesh.

    The first step's old log-probs come from one shared single-device computation (so only
    the train step compiles per mesh); later steps recompute them on the mesh. With the default optimizer the
    jitted step is built once per configuration (mesh, split, loss and step options) and shared by every run.
    """
    import dataclasses

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from drgrpo_jax.losses import LossConfig
    from drgrpo_jax.models.transformer import Transformer
    from drgrpo_jax.sharding import MeshShape, make_mesh, param_shardings, shard_model
    from drgrpo_jax.step.config import StepConfig
    from drgrpo_jax.step.train_step import (
        batch_shardings,
        init_state,
        jit_policy_logprobs,
        jit_train_step,
        state_shardings,
    )

    _count_compiles()
    # With the default optimizer the jitted functions depend only on these options (the lengths, the behaviour
    # shift and the step count are data), so runs that repeat a configuration share them: jax traces and lowers a
    # new jitted callable every time, even for the same program (~0.5 s a step on 2 cores).
    config_key = None if optimizer is not None else (
        tuple(mesh_shape), micro_batches, aggregation, kl_coef, tis_cap, on_policy, remat,
        tuple(sorted(dict(loss_options).items())), tuple(sorted(step_options.items())))
    cached = _STEP_FUNCTIONS.get(config_key) if config_key is not None else None
    if cached is None:
        data, fsdp, tensor = mesh_shape
        mesh = make_mesh(MeshShape(data=data, fsdp=fsdp, tensor=tensor), jax.devices()[: data * fsdp * tensor])
        optimizer = optimizer or optax.sgd(0.5)
    else:
        mesh, optimizer, shardings, step, old_logprobs = cached
    model = shard_model(Transformer(dataclasses.replace(tiny_decoder_config(), remat=remat), rngs=nnx.Rngs(0)), mesh)
    graphdef, state = init_state(model, optimizer, jax.random.key(0), with_reference=kl_coef > 0)
    if cached is None:
        loss = LossConfig(aggregation=aggregation, budget=STEP_RESPONSE, kl_coef=kl_coef, **dict(loss_options))
        config = StepConfig(loss=loss,
                            micro_batches=micro_batches, tis_cap=tis_cap, logprob_chunk=5, on_policy=on_policy,
                            **step_options)
        params_shardings = param_shardings(state.params, mesh)
        shardings = state_shardings(state, params_shardings, mesh)
        step = jit_train_step(graphdef, optimizer, optax.constant_schedule(0.5), config, shardings, mesh)
        old_logprobs = jit_policy_logprobs(graphdef, config, params_shardings, mesh)
        if config_key is not None:
            _STEP_FUNCTIONS[config_key] = mesh, optimizer, shardings, step, old_logprobs
    state = jax.device_put(state, shardings)
    key = None if lengths is None else tuple(int(n) for n in lengths)
    batch = jax.device_put(make_step_batch(lengths=lengths), batch_shardings(mesh))
    history = []
    for i in range(steps):
        old = jax.device_put(initial_old_logprobs(key), batch.old_logprobs.sharding) if i == 0 else \
            old_logprobs(state.params, batch)
        batch = dataclasses.replace(batch, old_logprobs=jnp.full_like(old, jnp.nan) if on_policy else old,
                                    behaviour_logprobs=old + behaviour_shift)  # on-policy: old_logprobs unused
        state, metrics = step(state, batch)
        history.append(dict(jax.device_get(metrics), compiles_so_far=len(COMPILES)))
    return jax.device_get(state), history, step


def lora_step_fn(model, mesh_shape, micro_batches):
    """(placed state, one(state) -> (state, metrics), frozen shardings): on-policy LoRA steps (KL on, Adam) of a
    model carrying adapters on a (data, fsdp, tensor) mesh; each step recomputes its old log-probs on the mesh."""
    import dataclasses

    import jax
    import optax

    from drgrpo_jax.losses import LossConfig
    from drgrpo_jax.sharding import MeshShape, make_mesh, param_shardings
    from drgrpo_jax.step.config import StepConfig
    from drgrpo_jax.step.train_step import (
        batch_shardings,
        init_state,
        jit_policy_logprobs,
        jit_train_step,
        state_shardings,
    )

    data, fsdp, tensor = mesh_shape
    mesh = make_mesh(MeshShape(data=data, fsdp=fsdp, tensor=tensor), jax.devices()[:data * fsdp * tensor])
    optimizer = optax.adam(0.01, eps=1e-3)  # eps keeps Adam's first step from amplifying rounding in tiny gradients
    config = StepConfig(loss=LossConfig(budget=STEP_RESPONSE, kl_coef=0.1), micro_batches=micro_batches,
                        logprob_chunk=5)
    graphdef, state = init_state(model, optimizer, jax.random.key(0))
    params_shardings, frozen_shardings = param_shardings(state.params, mesh), param_shardings(state.frozen, mesh)
    shardings = state_shardings(state, params_shardings, mesh, frozen_shardings)
    step = jit_train_step(graphdef, optimizer, optax.constant_schedule(0.01), config, shardings, mesh)
    logprobs = jit_policy_logprobs(graphdef, config, params_shardings, mesh, frozen_shardings)
    batch = jax.device_put(make_step_batch(), batch_shardings(mesh))

    def one(state):
        old = logprobs(state.params, batch, state.frozen)
        return step(state, dataclasses.replace(batch, old_logprobs=old, behaviour_logprobs=old))

    return jax.device_put(state, shardings), one, frozen_shardings


def compiled_dots(compiled_text: str, shapes: bool = False) -> list[tuple[str, str, str]]:
    """(result, lhs, rhs) types of every dot, fused ones included, in an optimised (compiled) XLA program's text:
    element types (`f32`), or with `shapes` element types and dimensions (`f32[4,8]`).

    The compiled program's dot types are this CPU's: XLA upcasts a bf16 dot to float32 where the CPU has no
    bf16 dot instructions, so a test asserting bf16 dots skips there (the caller's numerics still ran).
    """
    import jax
    import pytest

    from drgrpo_jax.models.precision import native_bfloat16

    if not native_bfloat16(jax.devices()[0]):
        pytest.skip("the compiled bf16 dots are checked on CPUs with bf16 dot instructions (avx512_bf16, amx_bf16)")
    types = dict(re.findall(r"%([\w.\-]+) = (\w+\[[\d,]*\])", compiled_text))
    dots = re.findall(r"= (\w+\[[\d,]*\])\S* dot\(%([\w.\-]+), %([\w.\-]+)\)", compiled_text)
    kind = (lambda t: t) if shapes else (lambda t: t.split("[")[0])
    return [(kind(out), kind(types.get(lhs, "?")), kind(types.get(rhs, "?"))) for out, lhs, rhs in dots]


def assert_same(actual, desired, what):
    """Trees equal to float32 tolerance (relative to each leaf's largest entry)."""
    import jax

    for a, d in zip(jax.tree.leaves(actual), jax.tree.leaves(desired)):
        d = np.asarray(d)
        np.testing.assert_allclose(a, d, rtol=1e-5, atol=1e-5 * max(np.abs(d).max(), 1e-6), err_msg=what)


# ---------------------------------------------------------------------------------------------
# GDPO's reward components (tests/math/test_gdpo.py, tests/gdpo_two_process_worker.py)
# ---------------------------------------------------------------------------------------------

GDPO_WEIGHTS = [1.0, 0.5, 2.0]


def mixed_batch():
    """Components of very different scales, a collapsed component, ragged groups and padding slots."""
    rng = np.random.default_rng(0)
    shape = (7, 6)
    components = np.stack([rng.integers(0, 2, shape), rng.normal(300.0, 150.0, shape), rng.normal(0, 0.01, shape)], -1)
    components = components.astype(np.float32)
    components[0, :, 0] = 1.0  # correctness collapsed in group 0: contributes exactly 0
    components[1, :, :] = [0.0, 250.0, 0.005]  # every component collapsed: zero-signal group
    valid = np.ones(shape, bool)
    valid[2, 4:] = False  # ragged group of 4
    valid[3, 1:] = False  # a group of one
    valid[4, :] = False  # all padding
    components[~valid] = 1e6  # garbage in padding slots must not leak into any statistic
    return components, valid


def eight_group_batch():
    """The mixed batch with one more group, so 8 devices (or 2 processes x 4) hold whole groups each."""
    components, valid = mixed_batch()
    return np.concatenate([components, components[:1]]), np.concatenate([valid, valid[:1]])


# ---------------------------------------------------------------------------------------------
# What an offline W&B run wrote (tests/train/test_trackers.py, tests/train/test_train.py)
# ---------------------------------------------------------------------------------------------


def _wandb_records(path: str):
    """The protobuf records of a `run-ID.wandb` file: a LevelDB-style log of 32 KiB blocks, each record split
    into chunks with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    block, header = 32768, 7
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", path
    position, pending = header, b""
    while position + header <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position:position + header]) if left >= header else (0, 0, 0)
        if left < header or (length == 0 and kind == 0):  # block trailer or zero padding
            position += left
            continue
        pending += data[position + header:position + header + length]
        position += header + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_offline_run(wandb_dir: str, timeout_s: float = 60.0) -> tuple[dict, list[dict]]:
    """(config, history rows) of the one offline run under wandb_dir, decoded from its .wandb file once W&B's
    service process has written the run's exit record (it writes behind `finish`)."""
    import glob
    import time

    (path,) = glob.glob(os.path.join(wandb_dir, "offline-run-*", "run-*.wandb"))
    deadline = time.monotonic() + timeout_s
    while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(path)):
        assert time.monotonic() < deadline, f"{path}: no exit record after {timeout_s} s"
        time.sleep(0.5)
    config, history = {}, []
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return config, history
# The sampler's tiny model and the full-cache sampler it replaced (tests/sampler/)
# ---------------------------------------------------------------------------------------------

SAMPLER_VOCAB = 97


def tiny_sampler_model():
    """A tiny random Llama-family Transformer (GQA, untied head, EOS = vocab - 1); weights scaled up x10 so
    logits are peaked and continuations differ by prompt."""
    import jax
    from flax import nnx

    from drgrpo_jax.models.config import DecoderConfig
    from drgrpo_jax.models.transformer import Transformer

    config = DecoderConfig(family="llama", vocab_size=SAMPLER_VOCAB, hidden_size=32, intermediate_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128,
                           eos_token_ids=(SAMPLER_VOCAB - 1,))
    graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    return nnx.merge(graphdef, jax.tree.map(lambda x: x * 10.0 if x.ndim > 1 else x, state))


def full_cache_sample(model, batch, max_new_tokens: int) -> dict[str, np.ndarray]:
    """The sampler as it was before issue 14, as an oracle: every row prefilled on its own (its prompt repeated
    per sample), every step attending over all U + T - 1 slots, one step per Python iteration. Same draws
    (`sample_step` with each row's key and the step), so its tokens are what `generate` must give."""
    import jax
    import jax.numpy as jnp

    from drgrpo_jax.models.kv_cache import init_cache
    from drgrpo_jax.sampler.draws import row_keys, sample_step

    rows = batch.rows
    ids_BU = np.asarray(batch.prompt_ids_PU)[rows.prompt_index_B]
    positions_BU = np.asarray(batch.prompt_positions_PU)[rows.prompt_index_B]
    num_rows, prompt_len = ids_BU.shape
    decode = jax.jit(lambda m, ids, positions, cache: m.decode(ids, positions, cache))
    draw = jax.jit(sample_step)
    logits_BTV, cache = decode(model, ids_BU, positions_BU, init_cache(model.config, num_rows,
                                                                       prompt_len + max_new_tokens - 1))
    keys_B = row_keys(rows.seeds_B, rows.streams_B, rows.samples_B)
    out = {"tokens": np.zeros((num_rows, max_new_tokens), np.int32), "lengths": np.zeros(num_rows, np.int32),
           "logprobs": np.zeros((num_rows, max_new_tokens), np.float32), "stopped": np.zeros(num_rows, bool)}
    done_B = ~rows.live_B | (rows.max_new_tokens_B <= 0)
    tokens_B = np.zeros(num_rows, np.int32)  # the token fed at the next step
    for step in range(max_new_tokens):
        if step:
            positions_B1 = (rows.prompt_lengths_B + step - 1)[:, None]
            logits_BTV, cache = decode(model, jnp.asarray(tokens_B[:, None]), positions_B1, cache)
        tokens_B, logprobs_B = (np.asarray(x) for x in draw(logits_BTV[:, -1], keys_B, step, rows.temperature_B,
                                                             rows.top_k_B, rows.top_p_B))
        active_B = ~done_B
        out["tokens"][active_B, step] = tokens_B[active_B]
        out["logprobs"][active_B, step] = logprobs_B[active_B]
        out["lengths"] += active_B
        stop_B = active_B & (tokens_B[:, None] == rows.stop_ids_BE).any(-1)
        out["stopped"] |= stop_B
        done_B = done_B | stop_B | (out["lengths"] >= rows.max_new_tokens_B)
        if done_B.all():
            break
    return out
