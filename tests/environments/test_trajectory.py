"""The trajectory driver against a real tiny-model service: token-exact rows, a mask on exactly the model's tokens,
behaviour log-probs equal to transformers' over the whole trajectory, the trainer's own recomputed log-probs equal
to the service's, and the limits."""

import json

import numpy as np
import pytest

from drgrpo_jax.environments.chat import ChatRenderer
from drgrpo_jax.environments.trajectory import (
    EpisodeLimits,
    Trajectory,
    episode_metrics,
    run_episodes,
    trajectory_arrays,
)
from drgrpo_jax.rollout.client import RolloutClient
from drgrpo_jax.rollout.local_service import LocalServer

from support.chat_models import Chatty, write_chat_model

pytestmark = pytest.mark.subprocess  # the service runs as a child process

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_chat_model(str(tmp_path_factory.mktemp("chat") / "model"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def episodes(model_dir, tokenizer):
    limits = EpisodeLimits(max_turns=3, max_turn_tokens=12, max_model_tokens=30, max_total_tokens=80)
    examples = [{"prompt": p} for p in ("what is 2+3?", "add 17 and 5", "hello", "count to three")]
    with LocalServer(model_dir, extra_args=["--prefix-cache-bytes", "-1"]) as server, \
            RolloutClient(server.url) as client:
        first = run_episodes(client, tokenizer, Chatty, examples, limits=limits, seed=7)
        caches = [client.prefix_cache_delta()]  # since the service started: the first round's
        again = run_episodes(client, tokenizer, Chatty, examples, limits=limits, seed=7)
        caches.append(client.prefix_cache_delta())
        # Two hosts' shares (or two evaluation chunks), the second's first episode being the whole's third.
        split = (run_episodes(client, tokenizer, Chatty, examples[:2], limits=limits, seed=7)
                 + run_episodes(client, tokenizer, Chatty, examples[2:], limits=limits, seed=7, first_episode=2))
    return first, again, limits, split, caches


def test_an_episode_does_not_depend_on_the_episodes_beside_it(episodes):
    """Episode i's seeds come from (seed, turn, i): sampled in shares it is what it is sampled with every other."""
    first, _, _, split, _ = episodes
    assert [t.ids for t in split] == [t.ids for t in first]
    for alone, together in zip(split, first):
        # Float32 rounding differs with the batch shape (the ids do not): the sampler tests use the same bound.
        np.testing.assert_allclose(alone.behaviour_logprobs, together.behaviour_logprobs, atol=1e-4)


def test_rows_are_token_exact_and_the_mask_covers_exactly_the_model_tokens(episodes, tokenizer):
    trajectories, again, limits, _, _ = episodes
    assert [t.ids for t in trajectories] == [t.ids for t in again]  # the seed fixes every turn
    renderer = ChatRenderer(tokenizer)
    for t in trajectories:
        assert t.prompt_ids == renderer.opening_ids(t.messages[:1])
        assert t.model_tokens <= limits.max_model_tokens and len(t.ids) <= limits.max_total_tokens
        assert t.turns >= 1 and t.finish in ("done", "max_turns", "max_model_tokens", "max_total_tokens")
        mask = np.array(t.model_mask)
        # the model's runs decode to its turns, the environment's runs are the template's text between them
        runs, start = [], 0
        for k in range(1, len(mask) + 1):
            if k == len(mask) or mask[k] != mask[start]:
                runs.append((bool(mask[start]), t.ids[start:k]))
                start = k
        assert t.segments(tokenizer) == [(model, tokenizer.decode(ids)) for model, ids in runs]
        model_runs = [ids for model, ids in runs if model]
        env_runs = [ids for model, ids in runs if not model]
        assistant = [m["content"] for m in t.messages if m["role"] == "assistant"]
        assert [tokenizer.decode(ids, skip_special_tokens=True) for ids in model_runs] == assistant
        for ids in env_runs:
            text = tokenizer.decode(ids)
            assert "<|im_start|>user\ngo on" in text and text.endswith("<|im_start|>assistant\n")
        assert all(lp == 0.0 for lp, m in zip(t.behaviour_logprobs, t.model_mask) if not m)
        assert all(lp < 0.0 for lp, m in zip(t.behaviour_logprobs, t.model_mask) if m)
        assert t.rewards == ({"turn": 0.5 * t.turns} if t.finish in ("done", "max_turns") else t.rewards)
    assert any(t.turns > 1 and t.environment_tokens > 0 for t in trajectories)


def test_behaviour_logprobs_equal_transformers_over_the_whole_trajectory(episodes, model_dir):
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for t in episodes[0]:
        tokens = torch.tensor([t.prompt_ids + t.ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(tokens).logits[0, :-1].double(), -1)
        P = len(t.prompt_ids)
        picked = logprobs[P - 1:, :].gather(1, tokens[0, P:, None]).squeeze(1).numpy()
        mask = np.array(t.model_mask)
        np.testing.assert_allclose(np.array(t.behaviour_logprobs)[mask], picked[mask], atol=1e-4, rtol=0)


def test_the_trainers_recomputed_logprobs_equal_the_services(episodes, model_dir):
    import jax.numpy as jnp
    from flax import nnx

    from drgrpo_jax.models.pretrained import from_pretrained
    from drgrpo_jax.step.policy import response_logprobs

    trajectories, _, limits, _, _ = episodes
    rows = trajectory_arrays(trajectories, limits.max_total_tokens)
    U = max(len(t.prompt_ids) for t in trajectories)
    prompt_ids = np.zeros((len(trajectories), U), np.int32)
    prompt_mask = np.zeros((len(trajectories), U), bool)
    for r, t in enumerate(trajectories):  # left-padded, as the trainer's batch
        prompt_ids[r, U - len(t.prompt_ids):] = t.prompt_ids
        prompt_mask[r, U - len(t.prompt_ids):] = True
    model = from_pretrained(model_dir, dtype=jnp.float32)
    graphdef, params = nnx.split(model, nnx.Param)
    logprobs, _ = response_logprobs(graphdef, params, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask),
                                    jnp.asarray(rows.response_ids), jnp.asarray(rows.response_mask),
                                    temperature=1.0, chunk=16)
    mask = rows.loss_mask
    assert mask.sum() == sum(t.model_tokens for t in trajectories)
    np.testing.assert_allclose(np.asarray(logprobs)[mask], rows.behaviour_logprobs[mask], atol=1e-5, rtol=0)


def test_arrays_refuse_a_trajectory_longer_than_the_row(episodes):
    longest = max(len(t.ids) for t in episodes[0])
    with pytest.raises(ValueError, match="exceed the row length"):
        trajectory_arrays(episodes[0], longest - 1)


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_model_tokens"):
        EpisodeLimits(max_model_tokens=20, max_total_tokens=10)
    with pytest.raises(ValueError, match="max_turns"):
        EpisodeLimits(max_turns=0)
    assert json.dumps(EpisodeLimits().__dict__)


def test_episode_metrics_are_per_trajectory_means(episodes):
    trajectories = episodes[0]
    metrics = episode_metrics(trajectories)
    assert metrics["episode/turns"] == pytest.approx(np.mean([t.turns for t in trajectories]))
    assert metrics["episode/model_tokens"] + metrics["episode/environment_tokens"] == \
        pytest.approx(np.mean([len(t.ids) for t in trajectories]))
    assert sum(v for k, v in metrics.items() if k.startswith("episode/finish_")) == pytest.approx(1.0)
    assert episode_metrics([]) == {}


def test_an_episodes_reward_components_are_its_turns_rewards_or_its_counts():
    """environment.reward_components: what the turns reported (summed by the driver), else the episode's counts."""
    episode = Trajectory(prompt_ids=[1], turns=3, tool_calls=2, malformed_calls=1,
                         rewards={"found": 1.5, "tool_calls": -1.0})
    assert episode.reward_component("found") == 1.5
    assert episode.reward_component("tool_calls") == -1.0  # the environment's own value wins over the count
    assert (episode.reward_component("turns"), episode.reward_component("malformed_calls")) == (3.0, 1.0)
    assert episode.reward_component("never_reported") == 0.0


def test_the_services_prefix_cache_serves_the_later_turns_and_the_trainer_reads_it(episodes):
    """Each turn's prompt starts with the turn before it: the service prefills only what is new, and the client's
    reading after a round gives that round's counts; the same episodes again find most of it cached."""
    first_round, second_round = episodes[-1]
    assert first_round.hit_tokens > 0 and first_round.miss_tokens > 0  # turn 1 prefilled, later turns hit
    assert second_round.hit_tokens > 2 * second_round.miss_tokens  # a round's counts, not the service's totals
    assert first_round.budget_bytes > 0 and first_round.cached_blocks > 0
