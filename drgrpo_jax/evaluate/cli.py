"""`python -m drgrpo_jax.evaluate --model PATH_OR_URL --suite NAME [--k K] [--temperature T] [--max-new-tokens N]`.

Samples one greedy and k sampled completions per problem through the generation service (a local child service on
the model, or the given URLs), scores them with the training reward functions, and prints and writes accuracy
(greedy), avg@k, unbiased pass@k, response lengths of correct and incorrect answers and the truncation rate
(results.json, results.md, completions.jsonl under --output). A flag with a run-config counterpart takes its
default and its help from that key (drgrpo_jax/config/schema.py); "the run's" is the config.yaml of a run --model
names.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import time
from typing import Any

from tqdm.auto import tqdm

from drgrpo_jax.actor.actor import Actor
from drgrpo_jax.checkpoint import Checkpointer
from drgrpo_jax.config.api_keys import api_key
from drgrpo_jax.config.derived import optimizer_of
from drgrpo_jax.config.engines import ENGINE_TRAITS
from drgrpo_jax.config.flags import add_field_flag, add_flag
from drgrpo_jax.config.load import load_config, resolve_model_path
from drgrpo_jax.config.schema import (
    Config,
    DataConfig,
    EnvironmentConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
)
from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.environments.build import Episodes, build_episodes
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.evaluate.evaluation import EvalSettings, evaluate_problems
from drgrpo_jax.evaluate.report import markdown_table, report_rows, write_report
from drgrpo_jax.evaluate.suites import load_suite
from drgrpo_jax.hub_ids import hub_id
from drgrpo_jax.models.precision import DTYPES
from drgrpo_jax.models.pretrained import from_pretrained, load_tokenizer
from drgrpo_jax.rewards.scorer import RewardScorer
from drgrpo_jax.rollout.client import RolloutClient
from drgrpo_jax.rollout.local_service import LocalServer
from drgrpo_jax.rollout.weight_push import WeightPublisher
from drgrpo_jax.seeds import init_key
from drgrpo_jax.step.train_step import init_state

__all__ = ["ModelSource", "build_parser", "main", "resolve_model"]

PROG = "python -m drgrpo_jax.evaluate"
# Problems per request, and the rows of the evaluator's own child service, so that one request's greedy
# completions are one sampler call. Not drgrpo_jax.serve's default (config/serve.py DEFAULT_MAX_BATCH_SIZE): this
# child serves the evaluation alone, its batches sized to the evaluation's requests.
BATCH_PROMPTS = 64


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where completions come from: a local model (served by a child service) or running services."""

    path: str | None  # HF folder or .gguf to serve; None with urls
    urls: tuple[str, ...] = ()
    run_config: Config | None = None  # the training run's config, when --model is a run or its checkpoint
    checkpoint: tuple[str, int] | None = None  # (run directory, step) of an orbax checkpoint to export first


def _is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def _run_config(run_dir: str) -> Config:
    try:
        return load_config(os.path.join(run_dir, "config.yaml"))
    except ConfigError as error:
        raise ConfigError("--model", f"{run_dir}/config.yaml: {error}") from None


def resolve_model(specs: list[str], step: int | None = None) -> ModelSource:
    """--model given once (a local model) or as one or more URLs; ConfigError naming --model otherwise.

    A run directory (its final/ policy, or weights/vN with --step N; its config.yaml gives the prompt template,
    rewards and budget), a run's orbax checkpoint (RUN/checkpoints/N), an HF folder, a .gguf file, pkg:PACKAGE,
    a Hub id org/name[@revision] (fetched into the HF cache), or http(s)://HOST:PORT (repeat --model for several
    services; --tokenizer then names the tokenizer unless the service reports a local one).
    """
    if any(_is_url(s) for s in specs):
        if not all(_is_url(s) for s in specs):
            raise ConfigError("--model", "give either one local model or only http(s):// service URLs")
        return ModelSource(None, tuple(specs))
    if len(specs) != 1:
        raise ConfigError("--model", f"one local model at a time, got {len(specs)}")
    spec = os.path.normpath(specs[0]) if not specs[0].startswith("pkg:") else specs[0]
    parent = os.path.dirname(spec)
    if os.path.basename(parent) == "checkpoints" and os.path.basename(spec).isdigit():  # RUN/checkpoints/N
        run_dir = os.path.dirname(parent)
        return ModelSource(None, run_config=_run_config(run_dir), checkpoint=(run_dir, int(os.path.basename(spec))))
    if os.path.isfile(os.path.join(spec, "config.yaml")) and os.path.isdir(os.path.join(spec, "checkpoints")):
        folder = os.path.join(spec, "final") if step is None else os.path.join(spec, "weights", f"v{step}")
        if not os.path.isdir(folder):
            what = "final/ (the run has not finished)" if step is None else f"weights/v{step} (try RUN/checkpoints/N)"
            raise ConfigError("--model", f"run directory {spec} has no {what}")
        return ModelSource(folder, run_config=_run_config(spec))
    if step is not None:
        raise ConfigError("--step", "only applies to a run directory")
    return ModelSource(resolve_model_path(specs[0], key="--model"))


def export_checkpoint(run_dir: str, step: int, config: Config, output: str) -> str:
    """The policy of orbax checkpoint `step` of a run, written as an HF folder at `output`."""
    model_path = resolve_model_path(config.model.path, key=f"{run_dir}/config.yaml model.path")
    dtype = DTYPES[config.model.dtype]
    optimizer, _ = optimizer_of(config)
    graphdef, state = init_state(from_pretrained(model_path, dtype=dtype), optimizer, init_key(config.run.seed),
                                 with_reference=config.algorithm.kl_coef > 0)
    with Checkpointer(os.path.join(run_dir, "checkpoints"), save_every=1, keep=1 << 30) as checkpointer:
        if step not in checkpointer.all_steps():
            raise ConfigError("--model", f"{run_dir}/checkpoints has no step {step} "
                                         f"(steps: {checkpointer.all_steps()})")
        restored = checkpointer.restore(step, state)
    tokenizer = load_tokenizer(model_path, config.model.tokenizer_path)
    return WeightPublisher(output, graphdef).export(restored.state.params, output, tokenizer=tokenizer)


def _settings(args: argparse.Namespace, config: Config | None) -> EvalSettings:
    """EvalSettings from the flags (the run's budget when --max-new-tokens is not given)."""
    budget = args.max_new_tokens or (config or Config()).rollout.max_new_tokens  # 0 as not given, as it always was
    try:
        return EvalSettings(max_new_tokens=budget, samples=args.k, temperature=args.temperature, top_p=args.top_p,
                            greedy=args.greedy, seed=args.seed, chunk_prompts=args.batch_prompts)
    except ValueError as error:
        raise ConfigError("--k/--temperature/--max-new-tokens", str(error)) from None


def _data_config(args: argparse.Namespace, config: Config | None) -> DataConfig:
    """The prompt template: the flags given, else the run's, else data's defaults."""
    base = config.data if config is not None else DataConfig()
    given = {name: getattr(args, name) for name in ("template", "system_prompt", "use_chat_template")}
    changes = {name: value for name, value in given.items() if value is not None}
    if "{question}" not in changes.get("template", base.template):
        raise ConfigError("--template", "must contain the {question} placeholder")
    return dataclasses.replace(base, **changes)


def _reward_config(args: argparse.Namespace, config: Config | None) -> RewardConfig:
    """The training run's rewards (or --reward, default math_verify); `overlong` is a training penalty, left out."""
    if args.reward:
        return RewardConfig(functions=tuple(args.reward), num_workers=args.reward_workers)
    if config is None:
        return RewardConfig(num_workers=args.reward_workers)
    reward = config.reward
    keep = [i for i, f in enumerate(reward.functions) if f != "overlong"]
    if len(keep) == len(reward.functions):
        return dataclasses.replace(reward, num_workers=args.reward_workers)
    return dataclasses.replace(reward, functions=tuple(reward.functions[i] for i in keep), components=(), weights=(),
                               num_workers=args.reward_workers)


def _episodes(args: argparse.Namespace, config: Config | None, data: DataConfig, max_new_tokens: int,
              tokenizer: Any) -> Episodes | None:
    """--tools, else the run's environment section: each completion a multi-turn episode; None = plain ones."""
    environment = config.environment if config is not None else EnvironmentConfig()
    if args.tools:
        environment = dataclasses.replace(environment, tools=tuple(args.tools), factory=None)
    if args.no_tools or not environment.enabled:
        return None
    environment = dataclasses.replace(environment,
                                      max_model_tokens=min(environment.max_model_tokens, max_new_tokens))
    base = config if config is not None else Config()
    episode_config = dataclasses.replace(base, data=data, environment=environment,
                                         rollout=dataclasses.replace(base.rollout, max_new_tokens=max_new_tokens))
    return build_episodes(episode_config, tokenizer)


def _tokenizer(args: argparse.Namespace, source: ModelSource, client: RolloutClient) -> Any:
    """The tokenizer of the model (or --tokenizer); for URLs, the service's own when it is a local folder."""
    if source.path is not None:
        return load_tokenizer(source.path, args.tokenizer)
    asked = ENGINE_TRAITS[args.engine].serves_model_info  # else the service cannot say its tokenizer
    path = args.tokenizer or (client.model_info().get("tokenizer_path") if asked else "") or ""
    if not (os.path.isdir(path) or path.endswith(".gguf") or hub_id(path) is not None):
        raise ConfigError("--tokenizer", "needed with service URLs: a local tokenizer folder, a Hub id "
                                         "org/name[@revision] or the model's .gguf")
    return load_tokenizer(path, None) if path.endswith(".gguf") else load_tokenizer("", path)


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the evaluation the flags describe; returns results.json's content."""
    source = resolve_model(args.model, args.step)
    if not ENGINE_TRAITS[args.engine].starts_locally and not source.urls:
        raise ConfigError("--engine", f"{args.engine} is the API of service URLs; a local model is served by our own "
                                      "service (ours)")
    config = source.run_config
    key = api_key(args.api_key_env, "--api-key-env")  # before anything starts, as the trainer reads it
    settings = _settings(args, config)
    suite = load_suite(args.suite, size=args.size, seed=args.seed, problem_field=args.problem_field,
                       answer_field=args.answer_field)
    data, rewards = _data_config(args, config), _reward_config(args, config)
    output = args.output or os.path.join("evaluations", f"{_model_name(args.model)}-{suite.name.replace(':', '_')}")
    os.makedirs(output, exist_ok=True)
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        path = source.path
        if source.checkpoint is not None and config is not None:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="drgrpo_eval_"))
            path = export_checkpoint(*source.checkpoint, config, os.path.join(folder, "policy"))
        urls = list(source.urls)
        if path is not None:
            server = stack.enter_context(LocalServer(
                path, dtype=args.dtype, log_path=os.path.join(output, "serve.log"),
                extra_args=["--max-batch-size", str(args.max_batch_size)]))
            urls = [str(server.url)]
        client = stack.enter_context(RolloutClient(urls, timeout_s=args.timeout, api_key=key,
                                                   engine=args.engine))
        tokenizer = _tokenizer(args, dataclasses.replace(source, path=path), client)
        scorer = stack.enter_context(RewardScorer(rewards, budget=settings.max_new_tokens))
        episodes = _episodes(args, config, data, settings.max_new_tokens, tokenizer)
        actor = Actor(client, scorer, tokenizer, episodes)
        prompts = actor.prompt_ids(suite.examples, data)
        total = len(prompts) * (int(settings.greedy) + int(settings.samples > 0))
        with tqdm(total=total, desc=f"evaluate {suite.name}", unit="problem", file=sys.stderr,
                  dynamic_ncols=True) as bar:
            greedy, sampled = evaluate_problems(actor, suite.examples, prompts, settings, progress=bar.update)
    rows = report_rows(suite, greedy, sampled)
    header = {"model": " ".join(args.model), "suite": suite.name, "problems": len(suite.examples),
              "k": settings.samples,
              "temperature": settings.temperature, "max_new_tokens": settings.max_new_tokens, "seed": args.seed,
              "rewards": list(rewards.functions), "seconds": round(time.perf_counter() - start, 1),
              "tools": [tool.name for tool in episodes.make_environment().tools] if episodes is not None else []}
    paths = write_report(output, header, rows, suite, greedy, sampled)
    print(markdown_table(rows))
    print(f"written: {paths['results.json']}, {paths['results.md']}, {paths['completions.jsonl']}", file=sys.stderr)
    return {**header, "results": rows}


def _model_name(specs: list[str]) -> str:
    """A short name for the output folder: the model's folder or file name (a run's name with final/ or a step)."""
    spec = specs[0].rstrip("/")
    if _is_url(spec):
        return spec.split("://", 1)[1].replace(":", "_").replace("/", "_")
    path = os.path.normpath(spec.removeprefix("pkg:"))
    name, parent = os.path.basename(path), os.path.dirname(path)
    if name == "final" or os.path.basename(parent) in ("checkpoints", "weights"):
        run_dir = parent if name == "final" else os.path.dirname(parent)
        return f"{os.path.basename(os.path.abspath(run_dir))}-{name}"
    return os.path.splitext(name)[0]


_RUNS = "the run's"  # a flag not given takes the value of the run --model names, else its field's default


def build_parser() -> argparse.ArgumentParser:
    """The flags; those with a run-config counterpart are made from its field (one default, one help text)."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    add_field_flag(p, ModelConfig, "path", "--model", dest="model", action="append", required=True, default=None,
                   note="; or a training run folder (its final/, or weights/vSTEP with --step; its config.yaml gives "
                        "the prompt template, rewards and budget), a run's orbax checkpoint RUN/checkpoints/N, or "
                        "http(s)://HOST:PORT of a running generation service (repeat --model for several)")
    add_flag(p, "--suite", required=True, help="a named mix (chain_sum_1digit, arithmetic), rg:TASK[,TASK...] or a "
                                               ".jsonl file with problem/answer")
    add_field_flag(p, TrainConfig, "eval_samples", "--k", dest="k")
    add_field_flag(p, TrainConfig, "eval_temperature", "--temperature", dest="temperature")
    add_field_flag(p, RolloutConfig, "top_p")
    add_field_flag(p, RolloutConfig, "max_new_tokens", fallback=_RUNS)
    add_flag(p, "--no-greedy", dest="greedy", action="store_false", help="skip the greedy completion")
    add_flag(p, "--size", type=int, default=50, help="problems per reasoning-gym task; rows of a file (0 = all)")
    add_flag(p, "--seed", type=int, default=1234, help="seed of the generated problems and of the samples (not the "
                                                       "trainer's run.seed)")
    add_flag(p, "--step", type=int, help="with a run directory: evaluate weights/vSTEP instead of final/")
    add_field_flag(p, RewardConfig, "functions", "--reward", dest="reward", fallback=_RUNS + " without overlong")
    add_field_flag(p, RewardConfig, "num_workers", "--reward-workers", dest="reward_workers")
    add_field_flag(p, EnvironmentConfig, "tools", fallback=_RUNS,
                   note="; with tools each problem is answered in a multi-turn episode")
    add_flag(p, "--no-tools", dest="no_tools", action="store_true",
             help="plain completions even when the run trained with tools")
    add_field_flag(p, DataConfig, "template", fallback=_RUNS)
    add_field_flag(p, DataConfig, "system_prompt", fallback=_RUNS)
    add_field_flag(p, DataConfig, "use_chat_template", "--no-chat-template", fallback=_RUNS)
    add_flag(p, "--problem-field", help="JSONL field of the problem (default problem, else question)")
    add_field_flag(p, DataConfig, "answer_field", note="; text after a #### marker is kept")
    add_field_flag(p, ModelConfig, "tokenizer_path", "--tokenizer", dest="tokenizer",
                   note="; needed with service URLs unless the service reports a local one")
    add_field_flag(p, ServeConfig, "dtype", note=" of the local service")
    # Not serve's own default: this child serves the evaluation alone, a request of --batch-prompts problems at once.
    add_field_flag(p, ServeConfig, "max_batch_size", default=BATCH_PROMPTS, note=" of the local service")
    add_flag(p, "--batch-prompts", type=int, default=BATCH_PROMPTS, help="problems per request")
    add_field_flag(p, RolloutConfig, "timeout_s", "--timeout", dest="timeout")
    add_field_flag(p, RolloutConfig, "api_key_env", metavar="NAME")
    add_field_flag(p, RolloutConfig, "engine",
                   note="; here the API of the --model URLs (a local model is served by ours)")
    add_flag(p, "--output", "-o", help="report folder (default: evaluations/MODEL-SUITE)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """The CLI: a bad flag, model or suite exits 2 and a failed evaluation 1, each with one line on stderr."""
    args = parse_args(argv)
    try:
        evaluate(args)
    except ConfigError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # noqa: BLE001 - one line; the service log is in the output folder
        message = (str(error).strip().splitlines() or [""])[0][:500]
        print(f"{PROG}: {type(error).__name__}: {message}", file=sys.stderr)
        return 1
    return 0
