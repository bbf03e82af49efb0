"""drgrpo_jax inside Google's Tunix: the registered losses and advantages equal Tunix's built-ins where the two
define the same thing, differ exactly as documented where they do not, and a GRPOLearner run matches Tunix's own.

google-tunix pins packages the main environment is newer than, so these tests run in their own virtual environment
(.ci/run: .venv-tunix); elsewhere they are skipped with that reason.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tunix", reason="google-tunix is not installed here: .ci/run runs tests/integrations in "
                                    ".venv-tunix (pip install -e '.[tunix]' pytest)")

import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.rl import algo_core, common, function_registry  # noqa: E402, F401  (algo_core: Tunix's built-ins)
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import dapo_learner, drgrpo_learner, grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402
from tunix.tests import test_common  # noqa: E402

from drgrpo_jax.algorithms import compute_advantages  # noqa: E402
from drgrpo_jax.errors import FieldError  # noqa: E402
from drgrpo_jax.integrations import tunix as drgrpo_tunix  # noqa: E402

PAD, EOS = 0, 2  # MockVocab's <pad> and </s>
NAMES = drgrpo_tunix.register()


@pytest.fixture(autouse=True)
def tunix_rank_promotion():
    """Tunix's own code relies on numpy's implicit rank promotion, which the test suite otherwise refuses."""
    with jax.numpy_rank_promotion("allow"):
        yield


def toy_model(seed=0):
    return test_common.ToyTransformer(config=test_common.ModelConfig(vocab_size=test_common.MockVocab().GetPieceSize()),
                                      rngs=nnx.Rngs(seed))


def train_example(model, lengths=(6, 3, 5, 1), seed=0):
    """Four completions (two groups of two) of the given lengths, old and reference log-probs off the policy's."""
    rng = np.random.default_rng(seed)
    rows, width = len(lengths), 6
    prompt_ids = rng.integers(3, 20, size=(rows, 4))
    prompt_ids[1, :2] = PAD  # a left-padded prompt
    completion_ids = rng.integers(3, 20, size=(rows, width))
    completion_ids[np.arange(width)[None, :] >= np.asarray(lengths)[:, None]] = PAD
    mask = (completion_ids != PAD).astype(np.int32)
    graphdef, state = nnx.split(model)
    logprobs = common.compute_per_token_logps(graphdef, state, prompt_tokens=jnp.asarray(prompt_ids),
                                              completion_tokens=jnp.asarray(completion_ids), pad_id=PAD, eos_id=EOS)
    logprobs = np.asarray(logprobs)
    return common.TrainExample(
        prompt_ids=jnp.asarray(prompt_ids), prompt_mask=jnp.asarray(prompt_ids != PAD),
        completion_ids=jnp.asarray(completion_ids), completion_mask=jnp.asarray(mask),
        advantages=jnp.asarray(rng.normal(size=rows), jnp.float32),
        ref_per_token_logps=jnp.asarray(logprobs + rng.normal(0, 0.1, logprobs.shape), jnp.float32),
        old_per_token_logps=jnp.asarray(logprobs + rng.normal(0, 0.3, logprobs.shape), jnp.float32))


def with_temperature(config):
    config.temperature = 1.0  # the learner sets it from the rollout config
    return config


# Tunix's built-in configuration of each algorithm, and ours registered under drgrpo_jax/<name>.
PAIRS = {
    "dr_grpo": lambda: drgrpo_learner.DrGRPOConfig(num_generations=2, beta=0.04),
    "grpo": lambda: grpo_learner.GRPOConfig(num_generations=2, beta=0.04, kl_loss_mode="low_var_kl"),
    "dapo": lambda: dapo_learner.DAPOConfig(num_generations=2),
    "rloo": lambda: grpo_learner.GRPOConfig(num_generations=2, beta=0.04, loss_agg_mode="seq-mean-token-sum",
                                            kl_loss_mode="mse_kl"),
    "gspo_token": lambda: grpo_learner.GRPOConfig(num_generations=2, beta=0.0, loss_algo="gspo-token", epsilon=0.05),
}


def both_losses(algorithm, model, example, config):
    theirs = function_registry.get_policy_loss_fn(config.policy_loss_fn)
    ours = function_registry.get_policy_loss_fn("drgrpo_jax/" + algorithm)
    results = []
    for fn in (theirs, ours):
        def loss(m, fn=fn):
            return fn(m, example, config, PAD, EOS)

        (value, aux), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        results.append((value, aux, grads))
    return results


@pytest.mark.parametrize("algorithm", sorted(PAIRS))
def test_losses_clip_fraction_and_gradients_equal_tunix(algorithm):
    model, config = toy_model(), with_temperature(PAIRS[algorithm]())
    example = train_example(model)
    (theirs, their_aux, their_grads), (ours, our_aux, our_grads) = both_losses(algorithm, model, example, config)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    np.testing.assert_allclose(our_aux["pg_clipfrac"], their_aux["pg_clipfrac"], rtol=1e-6)
    assert 0 < float(our_aux["pg_clipfrac"]) < 1, "the example should exercise the clip"
    np.testing.assert_allclose(our_aux["kl"], their_aux["kl"], rtol=1e-5, atol=1e-7)
    flat_theirs, flat_ours = jax.tree.leaves(their_grads), jax.tree.leaves(our_grads)
    assert len(flat_theirs) == len(flat_ours) and any(np.abs(g).max() > 0 for g in flat_ours)
    for a, b in zip(flat_ours, flat_theirs):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_an_empty_completion_counts_in_dr_grpo_where_tunix_skips_it():
    # Tunix divides by the completions with a token (3); Dr.GRPO by every response of the window (4).
    model, config = toy_model(), with_temperature(PAIRS["dr_grpo"]())
    example = train_example(model, lengths=(6, 3, 0, 2))
    (theirs, _, _), (ours, _, _) = both_losses("dr_grpo", model, example, config)
    np.testing.assert_allclose(ours, theirs * 3 / 4, rtol=1e-5)


def test_sampler_importance_weights_scale_each_tokens_policy_gradient_as_tunix():
    model, config = toy_model(), with_temperature(PAIRS["dr_grpo"]())
    config.beta = 0.0  # Tunix weights the policy-gradient term only; our KL term is left alone likewise
    example = train_example(model)
    weights = np.random.default_rng(1).uniform(0.2, 1.5, size=example.completion_mask.shape)
    example = dataclasses.replace(example, sampler_is_weights=jnp.asarray(weights, jnp.float32))
    (theirs, _, their_grads), (ours, _, our_grads) = both_losses("dr_grpo", model, example, config)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(our_grads), jax.tree.leaves(their_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_advantage_estimators_equal_tunix():
    rewards = np.random.default_rng(0).normal(size=12).astype(np.float32)
    for ours, theirs in (("dr_grpo", "drgrpo"), ("grpo", "grpo"), ("rloo", "rloo")):
        mine = function_registry.get_advantage_estimator("drgrpo_jax/" + ours)(rewards=rewards, num_generations=3)
        want = function_registry.get_advantage_estimator(theirs)(rewards=rewards, num_generations=3)
        np.testing.assert_allclose(mine, np.asarray(want).reshape(-1), rtol=1e-5, atol=1e-6, err_msg=ours)


def completion_length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def says_hello(prompts, completions, **kwargs):
    return [float("hello" in c) for c in completions]


def test_per_reward_manager_keeps_one_column_per_reward_and_gdpo_reads_them():
    config = grpo_learner.GRPOConfig(num_generations=2, reward_manager=drgrpo_tunix.PER_REWARD)
    manager = function_registry.get_reward_manager(drgrpo_tunix.PER_REWARD)([completion_length, says_hello], config)
    summed = function_registry.get_reward_manager("sequence-level")([completion_length, says_hello], config)
    prompts, completions = ["a", "a", "b", "b"], ["hello there", "x", "yy", "hello"]
    rewards = manager(prompts, completions)["rewards"]
    np.testing.assert_array_equal(rewards, [[11, 1], [1, 0], [2, 0], [5, 1]])
    np.testing.assert_array_equal(rewards.sum(axis=1), summed(prompts, completions)["rewards"])
    drgrpo_tunix.register(reward_weights=[1.0, 0.5])
    try:
        advantages = function_registry.get_advantage_estimator("drgrpo_jax/gdpo")(rewards=rewards, num_generations=2)
    finally:
        drgrpo_tunix.register()
    want = compute_advantages("gdpo", rewards.reshape(2, 2, 2), weights=[1.0, 0.5])
    np.testing.assert_allclose(advantages, np.asarray(want).reshape(-1), rtol=1e-6)
    with pytest.raises(FieldError, match="reward_weights"):
        drgrpo_tunix.advantage_estimator("gdpo", rewards, 2, reward_weights=[1.0])


def test_what_the_adapter_cannot_take_is_refused_naming_it():
    model = toy_model()
    example = dataclasses.replace(train_example(model), segment_ids=jnp.ones((4, 10), jnp.int32))
    with pytest.raises(ValueError, match="packed sequences"):
        drgrpo_tunix.policy_loss("dr_grpo", model, example, with_temperature(PAIRS["dr_grpo"]()), PAD, EOS)
    config = with_temperature(grpo_learner.GRPOConfig(num_generations=2, kl_clamp_value=10.0))
    with pytest.raises(FieldError, match="kl_clamp_value"):
        drgrpo_tunix.policy_loss("dr_grpo", model, train_example(model), config, PAD, EOS)
    with pytest.raises(FieldError, match="kl_loss_mode"):
        drgrpo_tunix.loss_config("dr_grpo", grpo_learner.GRPOConfig(num_generations=2, kl_loss_mode="k3"), 6)


def test_names_are_registered_for_every_algorithm():
    assert NAMES["policy_loss_fn"] == NAMES["advantage_estimator"]
    assert "drgrpo_jax/dr_grpo" in NAMES["policy_loss_fn"] and "drgrpo_jax/gdpo" in NAMES["advantage_estimator"]
    for name in NAMES["policy_loss_fn"]:
        assert function_registry.get_policy_loss_fn(name) is not None


# ---------------------------------------------------------------------------------------------
# A GRPOLearner run on CPU: ours registered by name against Tunix's own Dr.GRPO
# ---------------------------------------------------------------------------------------------

PROMPTS = ["hello world", "My name", "hello there", "input string"]


def learner_run(config, steps=3, train_micro_batch_size=None):
    """`steps` GRPOLearner steps of a toy model from the same initial weights; (losses, final params, lengths).

    Two prompts a step, sampled and scored together whatever the training micro-batch, so every run sees the same
    completions.
    """
    model, reference = toy_model(), toy_model()
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)  # the toy model's layers expect Auto
    training = rl_cluster_lib.RLTrainingConfig(actor_optimizer=optax.sgd(0.2), eval_every_n_steps=1000,
                                               max_steps=steps, mini_batch_size=2,
                                               train_micro_batch_size=train_micro_batch_size,
                                               rollout_micro_batch_size=2, compute_logps_micro_batch_size=2)
    rollout = base_rollout.RolloutConfig(max_tokens_to_generate=8, max_prompt_length=4, kv_cache_size=32)
    roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
    cluster = rl_cluster_lib.RLCluster(
        actor=model, reference=reference, tokenizer=test_common.MockVocab(),
        cluster_config=rl_cluster_lib.ClusterConfig(role_to_mesh=dict.fromkeys(roles, mesh), rollout_engine="vanilla",
                                                    training_config=training, rollout_config=rollout))
    lengths = []

    def reward(prompts, completions, **kwargs):
        lengths.extend(len(c.split()) for c in completions)
        return [float(len(c)) for c in completions]

    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=config, reward_fns=[reward])
    # numpy arrays of prompts: Tunix repeats each leaf of the batch
    data = [{"prompts": np.array(PROMPTS[2 * (i % 2): 2 * (i % 2) + 2])} for i in range(steps)]
    learner.train(data)
    losses = cluster.actor_trainer.metrics_logger.get_metric_history("actor", "loss", "train")
    return np.asarray(losses), nnx.state(cluster.actor_trainer.model, nnx.Param), lengths  # the cluster reshards a copy


@pytest.mark.heavy
def test_grpo_learner_with_our_dr_grpo_equals_tunix_dr_grpo():
    ours = grpo_learner.GRPOConfig(num_generations=2, beta=0.04, policy_loss_fn="drgrpo_jax/dr_grpo",
                                   advantage_estimator="drgrpo_jax/dr_grpo")
    our_losses, our_params, lengths = learner_run(ours)
    their_losses, their_params, _ = learner_run(drgrpo_learner.DrGRPOConfig(num_generations=2, beta=0.04))
    # The two agree only where no completion is empty (see the test above); the run must not hide that case.
    assert min(lengths) > 0 and len(set(lengths)) > 1
    assert len(our_losses) == 3
    np.testing.assert_allclose(our_losses, their_losses, rtol=1e-5, atol=1e-7)
    initial = nnx.state(toy_model(), nnx.Param)
    moved = max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(our_params), jax.tree.leaves(initial)))
    assert moved > 1e-3
    for a, b in zip(jax.tree.leaves(our_params), jax.tree.leaves(their_params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.heavy
def test_under_tunix_gradient_accumulation_fixed_budget_stays_exact_and_token_mean_does_not():
    # Tunix averages the gradients of its equal micro-batches (optax.MultiSteps); a registered loss sees one.
    def final_params(algorithm, micro):
        config = grpo_learner.GRPOConfig(num_generations=2, beta=0.0, policy_loss_fn="drgrpo_jax/" + algorithm,
                                         advantage_estimator="drgrpo_jax/" + algorithm)
        return jax.tree.leaves(learner_run(config, steps=1, train_micro_batch_size=micro)[1])

    def largest_difference(a, b):
        return max(float(np.abs(x - y).max()) for x, y in zip(a, b))

    whole, accumulated = final_params("dr_grpo", None), final_params("dr_grpo", 1)
    assert largest_difference(whole, accumulated) < 1e-5
    whole, accumulated = final_params("dapo", None), final_params("dapo", 1)
    assert largest_difference(whole, accumulated) > 1e-4  # the documented limit: the mean of two token means
