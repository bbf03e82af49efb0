"""A short training run of a tiny Qwen3-MoE with model.moe.router_replay and both router terms on: the trainer asks
its service for the routed experts, replays them, and logs the router's terms and per-layer expert loads to
metrics.jsonl and TensorBoard."""

import json
import os

import pytest

from support.tiny_models import CHARS, TINY_VOCAB, save_char_tokenizer, write_tiny_qwen3_moe
from support.trainer_runs import start_trainer, trainer_overrides

ROUTER_KEYS = ["router_aux_loss", "router_z_loss", "expert_max_share/0", "expert_max_share/1", "expert_entropy/0",
               "expert_entropy/1"]


@pytest.mark.subprocess  # the trainer CLI and its generation service
@pytest.mark.slow  # one trainer run with its service (~1 minute on 2 busy cores)
def test_a_replayed_moe_run_logs_the_router_metrics(tmp_path, prompts_file):
    model = write_tiny_qwen3_moe(str(tmp_path / "moe"), vocab_size=TINY_VOCAB)
    save_char_tokenizer(model, CHARS[:TINY_VOCAB - 3])
    output_dir = tmp_path / "run"
    overrides = [*trainer_overrides(model, prompts_file, output_dir, steps=2), "train.eval_every=0",
                 "model.moe.router_replay=true", "model.moe.router_aux_coef=0.01", "model.moe.router_z_coef=0.001"]
    process = start_trainer(overrides)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    with open(output_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if '"loss"' in line]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["router_aux_loss"] >= 1.0 - 1e-6  # Switch's loss is 1 when balanced, more otherwise
        assert row["router_z_loss"] > 0
        for layer in (0, 1):
            assert 1 / 8 - 1e-6 <= row[f"expert_max_share/{layer}"] <= 1
            assert 0 <= row[f"expert_entropy/{layer}"] <= 2.0795  # log 8
    folder = output_dir / "tensorboard"
    events = b"".join((folder / name).read_bytes() for name in os.listdir(folder))
    assert all(key.encode() in events for key in ROUTER_KEYS)  # each scalar's tag, as the event protos hold it
