"""How often a model calls its tools, and one episode with its loss mask, through a child service of its own.

    python scripts/probe_tool_use.py --config configs/tool_quickstart.yaml --episodes 16 [--held-out] [overrides...]

Prints one JSON object: episodes, those with a call attempt, calls that ran, tool errors, malformed calls, mean
turns and model tokens, how many math-verify scores right on their last turn, and the first episode as runs of
its tokens with who wrote them (`model`: True where the loss mask is). A trained run's model is probed with the
override `model.path=RUN/final`, on the problems it did not train on with --held-out.
"""

from __future__ import annotations

import argparse
import json

from drgrpo_jax.config.load import load_config, resolve_model_path
from drgrpo_jax.data.sources import load_dataset
from drgrpo_jax.environments.build import build_episodes
from drgrpo_jax.environments.trajectory import episode_metrics, run_episodes
from drgrpo_jax.models.pretrained import load_tokenizer
from drgrpo_jax.rewards.functions import math_verify_reward
from drgrpo_jax.rollout.client import RolloutClient
from drgrpo_jax.rollout.local_service import LocalServer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held-out", action="store_true", help="the held-out problems (data.eval_size of them)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    config = load_config(args.config, args.overrides)
    if not config.environment.enabled:
        raise SystemExit(f"{args.config}: environment.tools or environment.factory must be set")
    model = resolve_model_path(config.model.path)
    tokenizer = load_tokenizer(model, config.model.tokenizer_path)
    dataset = load_dataset(config.data, config.run.seed)
    examples = (dataset.eval if args.held_out else dataset.train)[:args.episodes]
    if not examples:
        raise SystemExit(f"{args.config}: no {'held-out' if args.held_out else 'training'} problems to probe"
                         + (" (data.eval_size is 0)" if args.held_out else ""))
    episodes = build_episodes(config, tokenizer)
    with LocalServer(model, dtype=config.model.dtype) as server, RolloutClient(server.url) as client:
        trajectories = run_episodes(client, tokenizer, episodes.make_environment,
                                    [episodes.example(e) for e in examples], limits=episodes.limits, seed=args.seed,
                                    temperature=config.rollout.temperature, renderer=episodes.renderer)
    correct = [math_verify_reward(t.final_answer, e, answer_format=config.reward.answer_format)
               for t, e in zip(trajectories, examples)]
    report = {"config": args.config, "episodes": len(trajectories),
              "episodes_with_a_call": sum(t.tool_calls + t.malformed_calls > 0 for t in trajectories),
              "episodes_with_a_call_that_ran": sum(t.tool_calls > 0 for t in trajectories),
              "correct": sum(c >= 1.0 for c in correct), **episode_metrics(trajectories),
              "first_episode": [{"model": by_model, "text": text}
                                for by_model, text in trajectories[0].segments(tokenizer)]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
