"""The actor samples and scores one way for training and evaluation: the record's rows carry what the scorer and
the service gave, and a prompt over the budget is an error naming the key and the prompt."""

import numpy as np
import pytest

from drgrpo_jax.actor.actor import Actor, GroupSampling
from drgrpo_jax.config.schema import DataConfig
from drgrpo_jax.data.examples import Example
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.rewards.functions import RewardResult
from drgrpo_jax.rollout.client import Completions


class Client:
    def __init__(self):
        self.asked = {}

    def generate(self, prompts, group_size, **options):
        self.asked = options
        rows, budget = len(prompts) * group_size, options["max_new_tokens"]
        lengths = np.arange(1, rows + 1, dtype=np.int32) % budget + 1
        mask = np.arange(budget)[None, :] < lengths[:, None]
        return Completions(response_ids=np.where(mask, 7, 0).astype(np.int32),
                           behaviour_logprobs=np.where(mask, -0.5, 0).astype(np.float32), response_mask=mask,
                           lengths=lengths, truncated=lengths == budget, weight_versions=("3",) * rows,
                           token_versions=np.where(mask, 3, -1).astype(np.int32), group_size=group_size)

    def prefix_cache_delta(self):
        return None  # a service without a prefix cache


class Tokenizer:
    eos_token_id = 2

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["a" * len(row) for row in rows]


class Scorer:
    def score(self, texts, examples, lengths, given=None):
        components = np.asarray([[len(t) / 10.0] for t in texts], np.float32)
        return RewardResult(components, ("math_verify",), (1.0,), ("math_verify",), np.zeros(1, np.int64),
                            np.zeros(1, np.int64))


EXAMPLES = (Example("t/0", "q0", "a"), Example("t/1", "q1", "a"))


def test_one_call_scores_and_records_what_the_service_sampled():
    client = Client()
    actor = Actor(client, Scorer(), Tokenizer())
    prompts = [[1, 2], [3]]
    sampling = GroupSampling(group=2, max_new_tokens=4, temperature=0.5)
    scored = actor.sample_and_score(EXAMPLES, prompts, sampling, seed=9, expected_version=3, prompt_offset=6,
                                    record_prompt_tokens=8)
    assert client.asked["stop_token_ids"] == [2] and client.asked["prompt_offset"] == 6
    assert [len(t) for t in scored.texts] == scored.model_tokens.tolist()
    np.testing.assert_array_equal(scored.rows["components"], scored.rewards.components_NK)
    np.testing.assert_array_equal(scored.rows["weight_versions"], [3] * 4)
    assert scored.rows["response_ids"].shape == (4, 4)
    unrecorded = actor.sample_and_score(EXAMPLES, prompts, GroupSampling(group=2, max_new_tokens=4, ignore_eos=True),
                                        seed=9)
    assert unrecorded.rows is None and client.asked["stop_token_ids"] == [] and client.asked["ignore_eos"]


def test_a_prompt_over_the_budget_names_the_key_and_the_prompt():
    actor = Actor(Client(), Scorer(), Tokenizer())
    data = DataConfig(use_chat_template=False, template="{question}")
    assert actor.prompt_ids(EXAMPLES, data, 2) == [[113, 48], [113, 49]]
    with pytest.raises(ConfigError, match=r"rollout.max_prompt_tokens: prompt t/0 has 2 tokens, over the limit 1"):
        actor.prompt_ids(EXAMPLES, data, 1)
