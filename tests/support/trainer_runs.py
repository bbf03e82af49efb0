"""The trainer CLI on the tiny model, as a child process (`python -m drgrpo_jax.train`): its prompt file, its
overrides and environment, starting it, and killing and resuming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from support.paths import REPO, TESTS


def write_prompts(path: str, num: int) -> str:
    """Short arithmetic questions as JSONL (question/answer fields)."""
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(num):
            a, b = (int(x) for x in rng.integers(0, 10, 2))
            f.write(json.dumps({"question": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return path


def trainer_overrides(model: str, prompts: str, output_dir, steps: int) -> list[str]:
    """A 2-way data-parallel run: 4 prompts x 4 samples, 2 minibatches, eval and a checkpoint every 2 steps."""
    return [f"run.output_dir={output_dir}", "run.sample_every=2", f"model.path={model}",
            "data.source=jsonl", f"data.path={prompts}", "data.template='{question}'", "data.size=0",
            "data.eval_size=4", "rollout.group_size=4", "rollout.prompts_per_step=4", "rollout.max_new_tokens=12",
            "rollout.max_prompt_tokens=16", "algorithm.minibatches_per_rollout=2",
            "reward.functions=[support.reward_functions:has_letter_a,format]", "reward.num_workers=1",
            "optimizer.learning_rate=0.01", f"train.steps={steps}", "train.eval_every=2", "train.save_every=2",
            "mesh.data=2"]


def trainer_env() -> dict[str, str]:
    """The environment of a trainer child: tests/ importable (reward functions), 2 fake CPU devices, offline."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, TESTS]), "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "HF_HUB_OFFLINE": "1"}


def start_trainer(overrides: list[str], **env: str) -> subprocess.Popen:
    """`python -m drgrpo_jax.train OVERRIDES...` with stdout and stderr piped (extra environment variables: env)."""
    return subprocess.Popen([sys.executable, "-m", "drgrpo_jax.train", *overrides], cwd=REPO,
                            env={**trainer_env(), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def services_of(pid: int) -> list[int]:
    """The live generation-service processes trainer `pid` started (`python -m drgrpo_jax.serve ... --parent-pid
    PID`), read from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    args = f.read().split(b"\0")
            except OSError:
                continue
            if (b"drgrpo_jax.serve" in args and b"--parent-pid" in args
                    and args[args.index(b"--parent-pid") + 1] == str(pid).encode()):
                found.append(int(entry))
    return found


def kill_and_resume(overrides: list[str], output_dir, checkpoint: int, timeout: float) -> tuple[int, int]:
    """Runs the trainer, SIGKILLs it once checkpoint `checkpoint` exists in `output_dir`, then runs it again to the
    end (it resumes from that checkpoint); fails when the first run ends before the kill or the second fails.
    Returns the two processes' pids."""
    import pathlib
    import signal
    import time

    process = start_trainer(overrides)
    while not (pathlib.Path(output_dir) / "checkpoints" / str(checkpoint)).exists() and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    resumed = start_trainer(overrides)
    _, stderr = resumed.communicate(timeout=timeout)
    assert resumed.returncode == 0, stderr[-3000:]
    return process.pid, resumed.pid
