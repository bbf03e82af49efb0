"""The model card a Hub push writes (drgrpo_jax/train/hub.py `model_card`): Hub metadata that huggingface_hub
reads back, the base model, the algorithm and its key settings, the data, the final evaluation table, the command
that trained it, and the resolved config, which loads back to the same Config."""

import os
import re

import yaml

from drgrpo_jax.config.load import load_config
from drgrpo_jax.train.hub import model_card, push_folder

from support.hub_stand_in import StandInHub

QWEN = [f"model.path=Qwen/Qwen2.5-Math-1.5B@{'a' * 40}", "data.source=jsonl", "data.path=hiyouga/math12k",
        "data.eval_path=HuggingFaceH4/MATH-500", "data.eval_split=test", "data.prompt_field=problem",
        "data.answer_after=''", "rollout.group_size=8", "rollout.prompts_per_step=16", "rollout.max_new_tokens=3000",
        "algorithm.minibatches_per_rollout=2", "optimizer.learning_rate=1e-6", "train.steps=500",
        "train.eval_every=25", "reward.answer_format=answer_tags"]
COMMAND = "python -m drgrpo_jax.train --config configs/qwen.yaml model.path=Qwen/Qwen2.5-Math-1.5B"
EVAL = {"step": 500, "eval/num_prompts": 500, "eval/accuracy": 0.7125, "eval/avg@4": 0.6983333, "eval/pass@4": 0.84,
        "eval/response_length_mean": 612.25, "eval_seconds": 81.2}


def _section(card: str, title: str) -> str:
    """The text of the `## title` section."""
    return card.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_a_hub_base_model_and_hub_data():
    from huggingface_hub import ModelCard

    config = load_config(None, QWEN)
    card = model_card(config, command=COMMAND, evaluation=EVAL, repo_id="me/qwen-dr-grpo")
    data = ModelCard(card).data.to_dict()  # the metadata as the Hub reads it
    assert data["base_model"] == "Qwen/Qwen2.5-Math-1.5B"  # the repo, its revision left to the config below
    assert data["datasets"] == ["hiyouga/math12k", "HuggingFaceH4/MATH-500"]
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert {"drgrpo_jax", "dr_grpo"} <= set(data["tags"])
    assert card.split("---\n", 2)[2].startswith("\n# me/qwen-dr-grpo\n")
    assert "https://huggingface.co/Qwen/Qwen2.5-Math-1.5B" in _section(card, "Base model")
    settings = _section(card, "Algorithm and key settings")
    for row in ["| algorithm.name | dr_grpo |", "| rollout.group_size (G, completions per prompt) | 8 |",
                "| rollout.max_new_tokens (the budget) | 3000 |", "| optimizer.learning_rate | 1e-06 (constant, 0",
                "| train.steps | 500 |", "| reward.functions | math_verify (answer format: answer_tags) |",
                "| model.lora.rank | 0 (full fine-tuning) |", "| algorithm.clip_low / clip_high | 0.2 / 0.2 |"]:
        assert row in settings, row
    data_text = _section(card, "Data")
    assert "`hiyouga/math12k` (jsonl, split `train`" in data_text
    assert "`HuggingFaceH4/MATH-500` split `test`" in data_text and "{question}" in data_text
    evaluation = _section(card, "Evaluation")
    assert "after step 500" in evaluation
    assert re.findall(r"^\| (\S+) \| (\S+) \|$", evaluation, re.M) == [
        ("metric", "value"), ("num_prompts", "500"), ("accuracy", "0.7125"), ("avg@4", "0.6983"), ("pass@4", "0.84"),
        ("response_length_mean", "612.2")]
    assert f"```bash\n{COMMAND}\n```" in card


def test_the_resolved_config_in_the_card_loads_back(tmp_path):
    config = load_config(None, QWEN)
    card = model_card(config, command=COMMAND, evaluation=EVAL)
    resolved = card.split("```yaml\n", 1)[1].split("\n```", 1)[0]
    (tmp_path / "config.yaml").write_text(resolved)
    assert load_config(str(tmp_path / "config.yaml")) == config
    assert yaml.safe_load(resolved)["model"]["path"] == f"Qwen/Qwen2.5-Math-1.5B@{'a' * 40}"


def test_a_local_lora_run_without_evaluation():
    config = load_config(None, ["model.path=/models/smollm2", "model.lora.rank=8", "data.task=chain_sum",
                                "run.output_dir=runs/lora_quickstart"])
    card = model_card(config, command="python -m drgrpo_jax.train --config configs/lora.yaml")
    front = yaml.safe_load(card.split("---\n", 2)[1])
    assert "base_model" not in front and "datasets" not in front and front["library_name"] == "peft"
    assert card.split("---\n", 2)[2].startswith("\n# lora_quickstart\n")
    assert "A LoRA adapter (rank 8) trained from `/models/smollm2`" in card
    assert "(a local model)" in _section(card, "Base model")
    assert "| model.lora.rank | 8 (alpha 32, targets q_proj" in card
    assert "reasoning-gym task `chain_sum`" in _section(card, "Data")
    assert _section(card, "Evaluation").strip() == "No evaluation ran (train.eval_every = 0, or no held-out problems)."


def test_the_push_uploads_the_card_as_readme(tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    (final / "config.json").write_text("{}")
    (final / "model.safetensors").write_bytes(b"weights")
    card = model_card(load_config(None, QWEN), command=COMMAND, evaluation=EVAL, repo_id="me/policy")
    push_folder(str(final), "me/policy", card=card, api=StandInHub(str(tmp_path / "hub")))
    uploaded = tmp_path / "hub" / "me" / "policy"
    assert sorted(os.listdir(uploaded)) == ["README.md", "config.json", "model.safetensors"]
    assert (uploaded / "README.md").read_text() == card


def test_a_lora_run_pushes_its_adapter_folder(tmp_path):
    """With LoRA, final/ is a PEFT adapter folder (adapter_config.json, no config.json): it is pushed, card and all."""
    final = tmp_path / "final"
    final.mkdir()
    (final / "adapter_config.json").write_text("{}")
    (final / "adapter_model.safetensors").write_bytes(b"adapters")
    card = model_card(load_config(None, ["model.path=Qwen/Qwen2.5-Math-7B", "model.lora.rank=64"]), command=COMMAND)
    push_folder(str(final), "me/adapter", card=card, api=StandInHub(str(tmp_path / "hub")))
    assert sorted(os.listdir(tmp_path / "hub" / "me" / "adapter")) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors"]
