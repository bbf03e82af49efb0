"""The run config's sections: frozen typed dataclasses, each field with its default and its help text.

The one place that says what a config key means (`python -m drgrpo_jax.train --help` prints it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from drgrpo_jax.algorithms import ALGORITHMS
from drgrpo_jax.config.engines import EngineName
from drgrpo_jax.models.config import LORA_TARGETS
from drgrpo_jax.models.precision import DtypeName
from drgrpo_jax.models.remat import REMAT_POLICIES

__all__ = [
    "BUILTIN_REWARDS", "BUILTIN_TOOLS", "TRACKERS", "AlgorithmConfig", "Config", "DataConfig", "EnvironmentConfig",
    "LoraConfig", "MeshConfig", "ModelConfig", "MoeConfig",
    "OptimizerConfig", "RewardConfig", "RolloutConfig", "RunConfig", "TrainConfig"
]

# The reward functions reward.functions may name without an import path (drgrpo_jax/rewards/functions.py
# implements them; tests/rewards checks the two agree).
BUILTIN_REWARDS = ("math_verify", "format", "task", "overlong")
# The tools environment.tools may name without an import path (drgrpo_jax/environments/build.py builds them).
BUILTIN_TOOLS = ("calculator", "python")
# The trackers run.report_to may name (drgrpo_jax/train/trackers.py opens them; tests/config checks the two agree).
TRACKERS = ("tensorboard", "wandb", "mlflow")


def _f(default: Any, help: str, **more: Any) -> Any:
    """A dataclass field with a default and its one-line description (shown by describe_config); `more`: what
    else a command line made from the fields needs (config/serve.py's flags)."""
    return dataclasses.field(default=default, metadata={"help": help, **more})


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where the run writes and how it seeds."""

    output_dir: str = _f("runs/default", "run directory: config.yaml, metrics.jsonl, checkpoints, samples; a local "
                                         "folder or gs://bucket/path (needs gcsfs)")
    seed: int = _f(0, "root PRNG seed in [0, 2**32 - 1]; data order, sampling and init all derive from it")
    log_every: int = _f(1, "print a progress line every N steps (metrics.jsonl gets every step)")
    sample_every: int = _f(10, "write sample completions every N steps (0 = never)")
    weights_dir: str | None = _f(
        None, "where each weight version is copied for the services to load: a folder they all read or "
              "gs://bucket/path (needs gcsfs); null = run.output_dir/weights"
    )
    report_to: tuple[str, ...] = _f(
        ("tensorboard",), f"experiment trackers, any of {', '.join(TRACKERS)} (wandb and mlflow need their "
                          "extras: pip install -e '.[wandb]'); metrics.jsonl is always written"
    )
    project: str = _f("drgrpo_jax", "W&B project and MLflow experiment name")
    name: str = _f("", "run name in W&B and MLflow; empty = the name of run.output_dir")
    mlflow_tracking_uri: str = _f("", "MLflow tracking URI (e.g. file:/path/mlruns); empty = MLflow's default "
                                      "(MLFLOW_TRACKING_URI or ./mlruns)")
    push_to_hub: str | None = _f(None, "Hugging Face Hub repo id (user/name) the final policy is uploaded to at "
                                       "the end of the run (token: HF_TOKEN or huggingface-cli login); null = off")
    hub_private: bool = _f(True, "create the run.push_to_hub repo as private when it does not exist")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA: train low-rank adapters on frozen base weights (rank 0 = full fine-tuning)."""

    rank: int = _f(0, "adapter rank r; 0 = off (every weight trains)")
    alpha: float = _f(32.0, "the adapters' update is scaled by alpha / rank (PEFT's lora_alpha)")
    dropout: float = _f(0.0, "dropout on the adapters' input while training, in [0, 1)")
    targets: tuple[str, ...] = _f(LORA_TARGETS, "projections that get adapters: q_proj k_proj v_proj o_proj "
                                                 "(attention), gate_proj up_proj down_proj (MLP)")
    export_merged: bool = _f(False, "final/ also gets merged/: an HF folder of the base with the adapters merged")
    push: Literal["adapter", "merged"] = _f(
        "adapter", "what each weight push sends the services: the PEFT adapter folder (a few MB; drgrpo_jax.serve "
                   "merges it into its base) or the merged HF model (for servers that cannot load an adapter)")
    base_dtype: Literal["model", DtypeName, "int8"] = _f(
        "model", "how the trainer stores the frozen base's decoder projections: model (in model.dtype), float32, "
                 "bfloat16, or int8 (per-output-channel scales, dequantised in each GEMM: QLoRA-style memory); "
                 "embeddings and norms keep model.dtype; the services load the base from model.path as before")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts policy (Qwen3-MoE, GPT-OSS): router replay and the router's own loss terms."""

    router_replay: bool = _f(
        False, "the policy forward uses the experts the generation service's router chose for each sampled token "
               "(returned with the completion), weighted by the trained router, so trained and behaviour log-probs "
               "come from the same experts; needs a mixture-of-experts model.path")
    router_aux_coef: float = _f(0.0, "weight of Switch's load-balancing loss (1 when balanced) added to the loss; "
                                     ">= 0, 0 = off")
    router_z_coef: float = _f(0.0, "weight of ST-MoE's router z-loss (mean squared log-sum-exp of the router "
                                   "logits) added to the loss; >= 0, 0 = off")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The policy checkpoint."""

    path: str = _f(
        "", "the policy: a local HF folder (config.json + safetensors), a .gguf file, pkg:PACKAGE (its one .gguf), or "
            "a Hub id org/name[@revision] (fetched into the HF cache; a local path of that name wins)"
    )
    dtype: DtypeName = _f("float32", "parameter dtype; log-probs and losses stay float32")
    compute_dtype: Literal["auto", DtypeName] = _f(
        "auto", "dtype of the GEMMs in the train step and the trainer's own generation service (float32 "
                   "accumulation; params, optimizer state, log-probs and loss stay float32); auto = bfloat16 on "
                   "TPUs, Ampere+ GPUs and CPUs with AMX-BF16 or AVX512-BF16, float32 elsewhere")
    tokenizer_path: str | None = _f(None, "tokenizer folder or Hub id org/name[@revision] when it differs from "
                                          "the model's (null = the model's own)")
    remat: str = _f(
        "auto", f"what each decoder layer keeps for the backward pass: {', '.join(REMAT_POLICIES)} (most memory "
                "and least recomputation first; models/remat.py); auto = the first that fits the device; on a CPU "
                "full (as fast there, half the memory), save_attention_out from 2048 tokens a row where it fits "
                "(python -m drgrpo_jax.plan shows each policy's activations)")
    attention_impl: Literal["auto", "reference", "blockwise", "cudnn", "splash"] = _f(
        "auto", "self-attention of the training forward: auto (by backend and length), reference (quadratic memory), "
                "blockwise (flash-style, memory linear in length), cudnn (GPU), splash (TPU)"
    )
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig, metadata={
        "help": "LoRA: train low-rank adapters on the frozen base (rank 0 = off)"})
    moe: MoeConfig = dataclasses.field(default_factory=MoeConfig, metadata={
        "help": "a mixture of experts: router replay and the router's loss terms (all off by default)"})


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Prompts and reference answers."""

    source: Literal["reasoning_gym", "jsonl", "parquet", "hf_datasets"] = _f(
        "reasoning_gym", "where prompts come from: a reasoning-gym task, or the format of data.path: a JSONL or "
                         "Parquet file, or an HF dataset (a save_to_disk folder or a dataset folder); a Hub dataset id "
                         "in data.path is read through `datasets` with any of the three"
    )
    task: str = _f("basic_arithmetic", "reasoning-gym task name (source=reasoning_gym)")
    task_options: dict[str, Any] = dataclasses.field(
        default_factory=dict, metadata={"help": "extra keyword arguments of the reasoning-gym task config"}
    )
    path: str = _f("", "file or folder of the dataset, or a Hub dataset id org/name[@revision] (a local path of that "
                       "name wins; python -m drgrpo_jax.data prepare writes the math sets as JSONL)")
    eval_path: str = _f("", "separate held-out file/folder or Hub dataset id; empty = the held-out rows come from "
                            "data.path (data.eval_split, else data.eval_size rows held out of data.split)")
    subset: str = _f("", "the dataset's configuration (subset) of an HF dataset or Hub id, e.g. main for openai/gsm8k; "
                         "empty = its only or default one")
    split: str = _f("train", "split of an HF dataset or Hub id to train on")
    eval_split: str = _f("", "split of data.eval_path (else of data.path) to evaluate on; empty = data.split of "
                             "data.eval_path, or rows held out of data.path")
    prompt_field: str = _f("question", "field holding the question in file/HF rows")
    answer_field: str = _f("answer", "field holding the reference answer in file/HF rows")
    answer_after: str = _f("####", "keep only the text after the last occurrence of this marker (GSM8K); empty = off")
    size: int = _f(1000, "training examples (reasoning-gym: generated; files: at most this many, 0 = all)")
    eval_size: int = _f(64, "held-out examples for periodic evaluation (0 = no evaluation set)")
    template: str = _f(
        "{question}\nPut your final answer within \\boxed{}.", "user prompt; {question} is replaced by the question"
    )
    use_chat_template: bool = _f(True, "wrap the prompt in the tokenizer's chat template when it has one")
    system_prompt: str = _f("", "system message (chat template) or prefix line (plain prompts); empty = none")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Sampling G completions per prompt from the generation service."""

    urls: tuple[str, ...] = _f((), "generation service URLs; empty = start a local child service")
    engine: EngineName = _f(
        "ours", "the API the services at rollout.urls speak: ours (python -m drgrpo_jax.serve) and sglang, SGLang's "
                "native /generate; vllm, vLLM's /inference/v1/generate and a weight reload through its dev routes "
                "(start flags: docs/engines.md); the trainer's own child service is always ours")
    group_size: int = _f(8, "completions per prompt (G); a rollout's P * G * (max_prompt_tokens + max_new_tokens) "
                                   "tokens stay under 2**31 (int32 arrays)")
    prompts_per_step: int = _f(8, "prompts drawn per rollout (P); P * G responses per rollout")
    max_new_tokens: int = _f(256, "generation budget B; Dr.GRPO's loss divides by it")
    ignore_eos: bool = _f(
        False, "training rollouts do not stop at EOS (nor any stop token): every completion runs to the budget "
               "(benchmarks with equal work); evaluation still stops")
    max_prompt_tokens: int = _f(256, "prompts are left-padded to this length; longer prompts are an error")
    temperature: float = _f(1.0, "sampling temperature (> 0 for training rollouts)")
    top_p: float = _f(1.0, "nucleus sampling mass in (0, 1]; 1 = off")
    top_k: int = _f(0, "sample among the k most likely tokens; 0 = off")
    max_staleness: int = _f(0, "rollouts may come from a policy this many versions old; 0 = strictly on-policy; "
                               "with rollout.async, K: rounds are sampled K steps ahead of the update")
    timeout_s: float = _f(600.0, "seconds to wait for one generation request before failing")
    dynamic_sampling: bool = _f(
        False, "drop groups with no learning signal and draw more prompts until the batch is full (DAPO's filter)"
    )
    max_resample_rounds: int = _f(4, "dynamic sampling: extra rollouts per step at most; a batch still short is padded")
    service_batch_size: int | None = _f(
        None, "--max-batch-size of the trainer's local child service (null = a whole rollout or the eval set, "
              "whichever is larger)"
    )
    service_prefix_cache_bytes: int = _f(
        0, "--prefix-cache-bytes of the trainer's local child service: device memory for prompts' KV blocks kept "
           "across requests (docs/service.md#the-prefix-cache); -1 = a quarter of its batch budget; 0 = off"
    )
    service_mesh: str = _f(
        "", "the generation service's --mesh: tensor=T[,data=D] splits its sampler over T x D devices (heads, MLP "
            "and vocabulary on tensor, rows on data; docs/service.md); the trainer's local child service is started "
            "with it, services of rollout.urls are said to run with it (the plan's figures); empty = one device"
    )
    api_key_env: str = _f(
        "", "environment variable holding the services' API key (sent as Authorization: Bearer; the trainer's "
            "own child service is started with it); empty = no key"
    )
    # Throughput levers: where the weight push goes, and rollouts one step ahead of the update.
    weight_sync: Literal["auto", "shm", "disk"] = _f(
        "auto", "how weight pushes reach the services: shm = the trainer's own child maps a shared-memory segment "
                "(no disk write); disk = a versioned folder and /update_weights_from_disk; auto = shm for the child "
                "service unless model.lora.push=adapter or run.weights_dir is set, disk for rollout.urls")
    async_: bool = _f(
        False, "(YAML/CLI key: rollout.async) K-step-off rollouts, K = max_staleness (>= 1): step s+K's first round "
               "is sampled while step s's update runs, by the policy K versions older than the one that trains on it "
               "(a queue of K rounds; needs algorithm.tis_cap or mis_high to correct the lag)")
    inflight_updates: bool = _f(
        False, "with rollout.async: each weight push reaches the rounds still sampling at their next decode phase "
               "(the trainer's own service runs with --inflight-updates; services of rollout.urls must), so the "
               "push never waits for them; a checkpoint holds the queued rounds' scored rows instead of re-drawing "
               "them (one process)")


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """The advantage estimator and the loss."""

    # A name of the ALGORITHMS table: validation refuses any other with the table's own choices (config/derived.py).
    name: str = _f("dr_grpo", f"algorithm: {', '.join(ALGORITHMS)} (drgrpo_jax.algorithms); gspo's paper clips at "
                              "clip_low=3e-4, clip_high=4e-4")
    scale_rewards: bool = _f(False, "divide advantages by the group std (GRPO's; Dr.GRPO forbids it)")
    whiten_advantages: bool = _f(False, "whiten advantages over the batch (Dr.GRPO forbids it)")
    kl_in_reward: bool = _f(False, "put the KL penalty in the reward instead of the loss (Dr.GRPO forbids it)")
    clip_low: float = _f(0.2, "PPO ratio clip below: 1 - clip_low")
    clip_high: float | None = _f(None, "PPO ratio clip above: 1 + clip_high (null = clip_low; DAPO uses 0.28)")
    kl_coef: float = _f(0.0, "weight of the KL(policy || reference) term in the loss; 0 = no reference model")
    kl_estimator: Literal["k1", "k2", "k3"] = _f("k3", "Schulman's KL estimator")
    entropy_coef: float = _f(0.0, "entropy bonus weight (subtracted from the loss)")
    dual_clip: float | None = _f(None, "dual-clip bound c > 1 for negative advantages (null = off)")
    tis_cap: float | None = _f(None, "truncated importance weight cap C >= 1 for sampler/trainer mismatch (null = off)")
    tis_level: Literal["token", "sequence"] = _f(
        "token", "the mismatch ratio tis_cap and mis_high act on: per token, or the product over each response")
    mis_high: float | None = _f(
        None, "masked importance sampling: a response (sequence) or token whose mismatch ratio is above this "
              "(>= 1) gets weight 0, the rest their ratio (null = off; exclusive with tis_cap)")
    mis_low: float = _f(0.0, "masked importance sampling: also weight 0 below this ratio, in [0, 1]")
    ppo_epochs: int = _f(1, "passes over each rollout")
    minibatches_per_rollout: int = _f(1, "optimizer steps per pass; each takes P * G / this many responses")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Reward components: each function is one named component, or returns a dict of named ones."""

    functions: tuple[str, ...] = _f(
        ("math_verify",), f"built-ins ({', '.join(BUILTIN_REWARDS)}) or 'package.module:function' import paths"
    )
    components: tuple[str, ...] = _f(
        (), "component names: a function's name (it returns a number) or a key of the dict a function "
            "returns (empty = one component per function, named after it)"
    )
    weights: tuple[float, ...] = _f((), "one weight per component for the scalar reward, not all 0 (empty = all 1.0)")
    answer_format: Literal["boxed", "answer_tags"] = _f(
        "boxed", "where the final answer sits: \\boxed{...} or <answer>...</answer>"
    )
    timeout_s: float = _f(10.0, "seconds per reward call; a call over it is killed, scores 0 and is counted")
    num_workers: int = _f(2, "reward worker processes")
    overlong_buffer: int = _f(
        0, "the overlong reward (DAPO): 0 up to rollout.max_new_tokens - this many tokens, then linear to -1 at "
           "the budget; must be in [1, max_new_tokens] when reward.functions lists overlong")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with warmup and decay."""

    learning_rate: float = _f(1e-6, "peak learning rate, in (0, 1]")
    warmup_steps: int = _f(0, "linear warmup steps from 0 to the peak")
    decay: Literal["constant", "cosine", "linear"] = _f("constant", "schedule after warmup, to 0 at train.steps")
    weight_decay: float = _f(0.0, "decoupled weight decay")
    b1: float = _f(0.9, "Adam beta1")
    b2: float = _f(0.999, "Adam beta2")
    eps: float = _f(1e-8, "Adam epsilon")
    max_grad_norm: float = _f(1.0, "clip the global gradient norm to this, >= 0 (0 = no clipping)")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Steps, accumulation, evaluation and checkpoints."""

    steps: int = _f(100, "rollouts to train on (one rollout = ppo_epochs * minibatches_per_rollout updates)")
    micro_batches: int = _f(1, "gradient-accumulation slices of each optimizer step")
    pack_rows: int = _f(
        0, "packed training rows per device per micro-batch: each device packs its responses, each with its prompt, "
           "into this many rows of train.pack_length tokens (first-fit), so padding is not computed; a window that "
           "does not fit stops the run naming this key; 0 = off (every response padded to the longest prompt and "
           "the budget)")
    pack_length: int = _f(0, "tokens per packed row (with train.pack_rows); 0 = rollout.max_prompt_tokens + "
                             "rollout.max_new_tokens - 1, the longest prompt and response, so any one always fits")
    eval_every: int = _f(0, "evaluate on the held-out prompts every N steps and at the end (0 = never)")
    eval_samples: int = _f(4, "evaluation: k sampled completions per problem (held-out prompt) for avg@k and pass@k, "
                              "besides the greedy one (0 = greedy only)")
    eval_temperature: float = _f(0.6, "evaluation: temperature of the k sampled completions (> 0)")
    save_every: int = _f(50, "checkpoint every N steps (always at the end)")
    keep_checkpoints: int = _f(2, "keep the newest N checkpoints")
    checkpoint_optimizer: bool = _f(True, "save the optimizer's state in each checkpoint (AdamW's: twice the trained "
                                          "weights); false: weights only, about a third of the disk, and a resumed "
                                          "run restarts the optimizer's moments, so it no longer equals an "
                                          "uninterrupted run")
    resume: bool | None = _f(None, "continue from the latest checkpoint; null = when run.output_dir has one")


@dataclasses.dataclass(frozen=True)
class EnvironmentConfig:
    """Multi-turn episodes with tools (docs/tools.md): on when environment.tools or environment.factory is set.

    A trajectory's row holds the model's turns and the environment's; rollout.max_new_tokens is its length,
    and the loss trains only the model's tokens, its fixed budget being environment.max_model_tokens."""

    tools: tuple[str, ...] = _f((), f"tools the model may call: built-ins ({', '.join(BUILTIN_TOOLS)}) or "
                                    "'package.module:function' (a typed function or a Tool); empty = none")
    factory: str | None = _f(None, "'package.module:name' of a callable returning a fresh Environment per episode "
                                   "(environments/protocol.py); null = a ToolEnvironment over environment.tools")
    call_format: Literal["hermes", "llama3_json", "tag"] = _f(
        "hermes", "how the model writes calls: hermes (<tool_call> JSON, Qwen/Hermes), llama3_json, or tag (the "
                  "hermes JSON between environment.open_tag and close_tag, for templates without tools)")
    open_tag: str = _f("<tool_call>", "the tag format's opening tag")
    close_tag: str = _f("</tool_call>", "the tag format's closing tag")
    few_shot: str | None = _f(None, "a JSON file of chat messages (a worked episode: user, assistant with a call, "
                                    "tool, assistant) put before every question; null = none")
    reward_components: tuple[str, ...] = _f(
        (), "reward components the episode gives, each summed over its turns: what an environment reports in "
            "Observation.rewards, or the counts turns, tool_calls, tool_errors and malformed_calls; each is listed in "
            "reward.components (weights, GDPO's per-component advantages) and given by no reward function")
    max_turns: int = _f(4, "model turns per episode at most")
    max_turn_tokens: int = _f(128, "tokens of one model turn at most")
    max_model_tokens: int = _f(256, "the model's tokens in a whole trajectory at most: Dr.GRPO's fixed budget; "
                                     "<= rollout.max_new_tokens, which also holds the environment's tokens")
    max_tool_calls: int = _f(8, "tool calls per episode; the next one is answered with an error and ends it")
    tool_timeout_s: float = _f(30.0, "seconds an in-process tool may take before its call is answered with an error")
    python_timeout_s: float = _f(10.0, "the python tool: wall-clock seconds per call")
    python_memory_mb: int = _f(512, "the python tool: address space per call")
    python_sandbox: Literal["jail", "weak"] = _f(
        "jail", "the python tool's containment: jail (bubblewrap namespaces and a seccomp filter; the tool refuses "
                "to start without them) or weak (rlimits, a process group and an audit hook only: model-written code "
                "can escape it; docs/security.md)")

    @property
    def enabled(self) -> bool:
        return bool(self.tools) or self.factory is not None


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh and multi-host runtime."""

    data: int = _f(1, "data-parallel ways (batch split, parameters replicated)")
    fsdp: int = _f(1, "fully-sharded data-parallel ways (batch and parameters split)")
    tensor: int = _f(1, "tensor-parallel ways (heads and MLP split)")
    context: int = _f(1, "context-parallel ways (the token axis of every row split, for rows longer than one "
                         "device holds; python -m drgrpo_jax.plan advises it)")
    dcn_data: int = _f(1, "of mesh.data's ways, how many cross slices over the data-center network (multi-slice "
                          "TPU pods; divides mesh.data): each slice holds data/dcn_data x fsdp x tensor x context "
                          "devices")
    coordinator_address: str | None = _f(
        None, "process 0's host:port for jax.distributed (with mesh.num_processes and mesh.process_id); auto = "
              "JAX detects the cluster (TPU VM pods and multi-slice, GKE JobSet/indexed Job, SLURM, Open MPI) and "
              "every host runs the same command; null = single host")
    coordinator_port: int | None = _f(None, "with coordinator_address=auto: the port process 0 listens on "
                                            "(null = JAX's default for the detected cluster)")
    num_processes: int = _f(1, "JAX processes (hosts) in the run (detected with coordinator_address=auto)")
    process_id: int = _f(0, "this process's index in [0, num_processes) (detected with coordinator_address=auto)")

    @property
    def devices(self) -> int:
        """The devices the mesh takes: data x fsdp x tensor x context."""
        return self.data * self.fsdp * self.tensor * self.context


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole run."""

    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    environment: EnvironmentConfig = dataclasses.field(default_factory=EnvironmentConfig)
