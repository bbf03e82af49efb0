"""`run.push_to_hub`: the final policy (an HF folder) uploaded to a Hugging Face Hub model repo, with a model card
(README.md: the base model, the algorithm and its key settings, the data, the final evaluation, the command).

The token is huggingface_hub's own (HF_TOKEN, or `huggingface-cli login`); HF_ENDPOINT points it at
another Hub (a private mirror). The check runs at set-up, so an offline machine fails before training.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Any

from drgrpo_jax.config.load import dump_config
from drgrpo_jax.config.schema import Config
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.hub_ids import hub_id

__all__ = ["check_hub", "model_card", "push_folder"]


def check_hub(repo_id: str | None) -> None:
    """ConfigError naming run.push_to_hub when the upload could not happen at the end of the run."""
    if repo_id is None:
        return
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise ConfigError("run.push_to_hub", "HF_HUB_OFFLINE is set, so the final policy could not be uploaded "
                                             "(unset it, or set run.push_to_hub=null)")
    if importlib.util.find_spec("huggingface_hub") is None:
        raise ConfigError("run.push_to_hub", "huggingface_hub is not installed: pip install 'huggingface_hub>=0.34'")


def push_folder(folder: str, repo_id: str, *, private: bool = True, commit_message: str = "", card: str = "",
                api: Any = None) -> str:
    """Creates `repo_id` if needed and uploads `folder` (an HF model, or with LoRA a PEFT adapter) as one commit;
    returns the commit's URL.

    `card`: the model card, written as the folder's README.md first (empty = none). `api`: an
    `huggingface_hub.HfApi` (None = a default one; tests pass a stand-in with the same methods).
    """
    if not any(os.path.isfile(os.path.join(folder, name)) for name in ("config.json", "adapter_config.json")):
        raise ValueError(f"push_folder: {folder!r} is neither an HF model folder (config.json) nor a PEFT adapter "
                         "folder (adapter_config.json)")
    if card:
        with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as file:
            file.write(card)
    if api is None:
        from huggingface_hub import HfApi  # optional: check_hub says how to install it when it is missing

        api = HfApi()
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    commit = api.upload_folder(folder_path=folder, repo_id=repo_id, repo_type="model",
                               commit_message=commit_message or f"drgrpo_jax: {os.path.basename(folder)}")
    return str(getattr(commit, "commit_url", commit))


# ---------------------------------------------------------------------------------------------
# The model card
# ---------------------------------------------------------------------------------------------


def _repo(spec: str) -> str | None:
    """The Hub repo a config path names (its revision dropped: card metadata names repos), else None."""
    hub = hub_id(spec) if spec else None
    return None if hub is None else hub.repo_id


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _settings(config: Config) -> list[tuple[str, str]]:
    """(key, value) rows of the settings that say what was trained and how."""
    c, a, r = config, config.algorithm, config.rollout
    clip_high = a.clip_low if a.clip_high is None else a.clip_high
    rows = [
        ("algorithm.name", a.name),
        ("rollout.group_size (G, completions per prompt)", str(r.group_size)),
        ("rollout.prompts_per_step (P)", str(r.prompts_per_step)),
        ("rollout.max_new_tokens (the budget)", str(r.max_new_tokens)),
        ("rollout.temperature / top_p", f"{_number(r.temperature)} / {_number(r.top_p)}"),
        ("algorithm.clip_low / clip_high", f"{_number(a.clip_low)} / {_number(clip_high)}"),
        ("algorithm.kl_coef", _number(a.kl_coef)),
        ("algorithm.ppo_epochs / minibatches_per_rollout", f"{a.ppo_epochs} / {a.minibatches_per_rollout}"),
        ("optimizer.learning_rate", f"{_number(c.optimizer.learning_rate)} ({c.optimizer.decay}, "
                                    f"{c.optimizer.warmup_steps} warmup steps)"),
        ("train.steps", str(c.train.steps)),
        ("reward.functions", f"{', '.join(c.reward.functions)} (answer format: {c.reward.answer_format})"),
        ("model.dtype", c.model.dtype),
    ]
    if a.tis_cap is not None:
        rows.append(("algorithm.tis_cap", _number(a.tis_cap)))
    if r.async_:
        rows.append(("rollout.async", f"true (max_staleness {r.max_staleness})"))
    lora = c.model.lora
    rows.append(("model.lora.rank", f"{lora.rank} (alpha {_number(lora.alpha)}, targets {', '.join(lora.targets)})"
                 if lora.rank else "0 (full fine-tuning)"))
    return rows


def _data_lines(config: Config) -> list[str]:
    d = config.data
    if d.source == "reasoning_gym":
        options = f" with {dict(d.task_options)}" if d.task_options else ""
        lines = [f"- reasoning-gym task `{d.task}`{options}: {d.size} generated problems, {d.eval_size} held out "
                 f"(seed {config.run.seed})"]
    else:
        subset = f", subset `{d.subset}`" if d.subset else ""
        lines = [f"- training: `{d.path}` ({d.source}{subset}, split `{d.split}`; fields `{d.prompt_field}` / "
                 f"`{d.answer_field}`; {'all rows' if not d.size else f'at most {d.size} rows'})"]
        if d.eval_path or d.eval_split:
            held = f"`{d.eval_path or d.path}` split `{d.eval_split or d.split}`"
        else:
            held = f"{d.eval_size} rows held out of `{d.path}`"
        lines.append(f"- held out for evaluation: {held} (at most {d.eval_size} problems)")
    lines += ["", "Prompt template" + (" (inside the tokenizer's chat template)" if d.use_chat_template else "")
              + ":", "", "```text", d.template.strip(), "```"]
    return lines


def _evaluation_lines(config: Config, evaluation: Mapping[str, Any] | None) -> list[str]:
    if not evaluation:
        return ["No evaluation ran (train.eval_every = 0, or no held-out problems)."]
    t = config.train
    lines = [f"On the held-out problems after step {evaluation.get('step', config.train.steps)}: greedy accuracy, and "
             f"avg@k / pass@k of {t.eval_samples} samples at temperature {_number(t.eval_temperature)} (budget "
             f"{config.rollout.max_new_tokens} tokens).", "", "| metric | value |", "|---|---|"]
    for key, value in evaluation.items():
        if key.startswith("eval/") and isinstance(value, int | float) and not isinstance(value, bool):
            lines.append(f"| {key[len('eval/'):]} | {_number(value)} |")
    return lines


def model_card(config: Config, *, command: str, evaluation: Mapping[str, Any] | None = None,
               repo_id: str = "") -> str:
    """The README.md of a pushed policy: Hub metadata (base model, datasets, tags), the base model, the algorithm
    and its key settings, the data, the final evaluation table (`evaluation`: the trainer's last `eval/` row), the
    command that trained it and the whole resolved config."""
    c = config
    base, dataset, eval_dataset = _repo(c.model.path), _repo(c.data.path), _repo(c.data.eval_path)
    front = ["---"]
    if base:
        front.append(f"base_model: {base}")
    datasets = [d for d in dict.fromkeys([dataset, eval_dataset]) if d]
    if datasets:
        front += ["datasets:", *(f"- {d}" for d in datasets)]
    front += [f"library_name: {'peft' if c.model.lora.rank else 'transformers'}", "pipeline_tag: text-generation",
              "tags:", "- drgrpo_jax", "- reinforcement-learning", f"- {c.algorithm.name}", "---", ""]
    what = f"a LoRA adapter (rank {c.model.lora.rank})" if c.model.lora.rank else "a policy"
    title = repo_id or os.path.basename(os.path.normpath(c.run.output_dir))
    body = [f"# {title}", "",
            f"{what[0].upper() + what[1:]} trained from `{c.model.path}` with {c.algorithm.name} (reinforcement "
            "learning with verifiable rewards) by `drgrpo_jax`, in JAX.", "",
            "## Base model", "",
            f"`{c.model.path}`" + (f" ([{base}](https://huggingface.co/{base}))" if base else " (a local model)"),
            "", "## Algorithm and key settings", "", "| setting | value |", "|---|---|",
            *(f"| {key} | {value} |" for key, value in _settings(c)), "",
            "## Data", "", *_data_lines(c), "",
            "## Evaluation", "", *_evaluation_lines(c, evaluation), "",
            "## How it was trained", "", "```bash", command or "python -m drgrpo_jax.train --config config.yaml",
            "```", "", "<details><summary>The resolved config (config.yaml)</summary>", "", "```yaml",
            dump_config(c).rstrip(), "```", "", "</details>", ""]
    return "\n".join(front + body)
