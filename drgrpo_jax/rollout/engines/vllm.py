"""vLLM's HTTP API as an engine (`rollout.engine=vllm`, `VLLMEngine`): requests out, SGLang-shaped items back.

Generation is vLLM's token-in/token-out route (`/inference/v1/generate`, served with `--enable-scale-out`): one
request per prompt with `n` = G, its seed the prompt's (vLLM gives completion g of the group seed + g, so a group
never repeats one draw), and each sampled token's log-prob, which is the temperature-scaled policy's only when the
server runs with `--logprobs-mode processed_logprobs`. The answers are read through the checks every engine shares
(`engines/base.py`), named in vLLM's own fields (`choices[1].token_ids[3]`).
A weight push reloads the exported safetensors folder (`/collective_rpc` `reload_weights`) and then labels it
(`/update_weight_version`); both routes exist only under `VLLM_SERVER_DEV_MODE=1`. vLLM takes any label, so a
version that goes backwards is refused here (`check_forward`). `missing_setting` reads what a server exposes at
connect time and names the start-up setting it lacks. Router replay: a server started with
--enable-return-routed-experts answers each choice's `routed_experts` (base64 of a `.npy` [prompt + completion - 1,
L, k]), translated here into SGLang's `meta_info.routed_experts` (base64 of little-endian int32).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from drgrpo_jax.config.engines import EngineName
from drgrpo_jax.errors import ConfigError, RolloutError
from drgrpo_jax.rollout.engines.base import (
    Call,
    Completion,
    Engine,
    Request,
    Sampling,
    checked_tokens,
    described,
    finish_is_length,
    json_object,
    one_per_index,
    token_ids,
    token_versions,
    version_text,
)

__all__ = ["GENERATE_PATH", "VLLMEngine", "check_forward", "generate_body", "missing_routed_experts",
           "missing_setting", "read_choices", "weight_push_calls"]

GENERATE_PATH = "/inference/v1/generate"
_NEEDED_ROUTES = ((GENERATE_PATH, "start it with --enable-scale-out"),
                  ("/collective_rpc", "start it with VLLM_SERVER_DEV_MODE=1 in its environment"),
                  ("/update_weight_version", "start it with VLLM_SERVER_DEV_MODE=1 in its environment"))
_LOGPROBS_MODE = "processed_logprobs"  # the log-probs of the distribution sampled from: after temperature, top-k/p


def missing_setting(openapi: dict[str, Any], server_info: dict[str, Any]) -> str | None:
    """What the vLLM server described by its /openapi.json and /server_info?config_format=json lacks, as the
    start-up setting that fixes it; None when it has everything this client needs."""
    routes = openapi.get("paths", {})
    for route, fix in _NEEDED_ROUTES:
        if route not in routes:
            return f"no {route} route: {fix}"
    config = server_info.get("vllm_config", {})
    mode = config.get("model_config", {}).get("logprobs_mode") if isinstance(config, dict) else None
    if mode != _LOGPROBS_MODE:
        return (f"its log-probs are {mode!r}, not the sampled distribution's: start it with "
                f"--logprobs-mode {_LOGPROBS_MODE}")
    return None


def missing_routed_experts(server_info: dict[str, Any]) -> str | None:
    """Why the vLLM server described by /server_info?config_format=json returns no routed experts; None if it does."""
    config = server_info.get("vllm_config", {})
    aux = config.get("aux_output_config", {}) if isinstance(config, dict) else {}
    if not (isinstance(aux, dict) and aux.get("enable_return_routed_experts") is True):
        return "returns no routed experts: start it with --enable-return-routed-experts"
    return None


def _sglang_routed_experts(encoded: Any, field: str) -> str:
    """A choice's `routed_experts` (base64 of a .npy of uint8/uint16/int32) as SGLang's base64 of little-endian
    int32; RolloutError naming the field when it is no such array."""
    try:
        experts = np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)
    except (ValueError, OSError, TypeError, EOFError):
        raise RolloutError(f"{field}: not a base64 .npy array") from None
    if experts.dtype.kind not in "iu":
        raise RolloutError(f"{field}: {experts.dtype}, not integer expert ids")
    return base64.b64encode(experts.astype("<i4").tobytes()).decode("ascii")


def generate_body(prompt: Sequence[int], seed: int, group_size: int, *, max_new_tokens: int, temperature: float,
                  top_p: float, top_k: int, stop_token_ids: Sequence[int], ignore_eos: bool) -> dict[str, Any]:
    """The /inference/v1/generate body of G completions of one prompt, each with its sampled token's log-prob."""
    return {"token_ids": [int(t) for t in prompt], "sampling_params": {
        "n": group_size, "seed": int(seed), "max_tokens": max_new_tokens, "temperature": temperature,
        "top_p": top_p, "top_k": max(top_k, 0), "stop_token_ids": [int(t) for t in stop_token_ids],
        "ignore_eos": ignore_eos, "logprobs": 0, "detokenize": False}}


def read_choices(answer: Any, group_size: int, vocab_size: int | None) -> list[Completion]:
    """One /inference/v1/generate answer as its G checked completions, in the group's order (one choice per index).

    A completion's weight version is the first of its `weight_versions` spans: the oldest weights that sampled
    any of its tokens (a completion that crossed a push reports the version it started on, which the client's
    version check then refuses as it refuses any stale completion)."""
    choices = one_per_index(answer.get("choices") if isinstance(answer, dict) else answer, group_size, "choices")
    return [_read_choice(choice, f"choices[{g}]", vocab_size) for g, choice in enumerate(choices)]


def _read_choice(choice: dict[str, Any], where: str, vocab_size: int | None) -> Completion:
    """One vLLM choice (`token_ids`, `logprobs.content`, `finish_reason`, `weight_versions`) as a completion."""
    ids = token_ids(choice.get("token_ids"), f"{where}.token_ids", vocab_size)
    logprobs = choice.get("logprobs")
    field = f"{where}.logprobs.content"
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or len(content) != len(ids):
        raise RolloutError(f"{field}: {described(content)}, not one entry per token id ({len(ids)})")
    entries = []
    for position, entry in enumerate(content):
        if not isinstance(entry, dict):
            raise RolloutError(f"{field}[{position}]: {described(entry)}, not an object")
        entries.append((f"{field}[{position}]", entry.get("logprob"), entry.get("token_id")))
    spans = choice.get("weight_versions") or []
    first = spans[0] if isinstance(spans, list) and spans else {}
    if not isinstance(first, dict):
        raise RolloutError(f"{where}.weight_versions[0]: {described(first)}, not an object")
    version = version_text(first.get("version"), f"{where}.weight_versions[0].version")
    return Completion(ids=ids, logprobs=checked_tokens(ids, entries, vocab_size),
                      truncated=finish_is_length(choice.get("finish_reason"), f"{where}.finish_reason"),
                      weight_version=version, token_versions=token_versions(None, "", len(ids), version),
                      routed_experts=None if choice.get("routed_experts") is None else
                      _sglang_routed_experts(choice["routed_experts"], f"{where}.routed_experts"))


def check_forward(url: str, held: Any, version: str, *, rollback: bool) -> None:
    """RolloutError unless `version` is at least the numeric version the server at `url` holds (`held`, from
    /weight_info; None before the first push), or `rollback` allows going back."""
    held_text = None if held is None else str(held)
    if rollback or held_text is None or not (held_text.isdigit() and version.isdigit()):
        return
    if int(version) < int(held_text):
        raise RolloutError(f"{url}: weight version {version} is older than the {held_text} it holds (vLLM would "
                           "take it; only a resumed run may go back)")


def weight_push_calls(model_path: str, version: str) -> list[tuple[str, dict[str, Any]]]:
    """The (route, body) calls that load the safetensors folder `model_path` and label it `version`, in order."""
    return [("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": model_path}}),
            ("/update_weight_version", {"new_version": version})]


class VLLMEngine(Engine):
    """A vLLM server: one request per prompt, many in flight (vLLM batches what is in flight)."""

    name: ClassVar[EngineName] = "vllm"
    in_flight: ClassVar[int] = 64

    def generate_calls(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], shares: Sequence[Sequence[int]],
                       group_size: int, sampling: Sampling) -> list[Call]:
        """One /inference/v1/generate call per prompt, sent to its share's URL."""
        return [Call(k, GENERATE_PATH, generate_body(
            prompts[i], seeds[i], group_size, max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
            top_p=sampling.top_p, top_k=sampling.top_k, stop_token_ids=sampling.stop_token_ids,
            ignore_eos=sampling.ignore_eos), (i,)) for k, share in enumerate(shares) for i in share]

    def read_completions(self, answer: Any, group_size: int, vocab_size: int | None) -> list[Completion]:
        return read_choices(answer, group_size, vocab_size)

    def check_startup(self, url: str, request: Request) -> bool:
        """ConfigError naming the setting the server lacks, from its routes (and its config under dev mode)."""
        openapi = json_object(request("GET", url, "/openapi.json"), f"{url}/openapi.json: the answer")
        paths = json_object(openapi.get("paths", {}), f"{url}/openapi.json: paths")
        info = json_object(request("GET", url, "/server_info?config_format=json"),
                           f"{url}/server_info: the answer") if "/server_info" in paths else {}
        missing = missing_setting(openapi, info)
        if missing is not None:
            raise ConfigError("rollout.engine", f"{self.name}: {url} is not ready for training: {missing}")
        return True

    def check_routed_experts(self, url: str, request: Request) -> None:
        missing = missing_routed_experts(json_object(request("GET", url, "/server_info?config_format=json"),
                                                     f"{url}/server_info: the answer"))
        if missing is not None:
            raise ConfigError("model.moe.router_replay", f"{self.name}: {url} {missing}")

    def push_weights(self, url: str, model_path: str, version: str, rollback: bool, request: Request) -> None:
        """Reloads `model_path` and labels it `version`, unless that goes backwards."""
        held = request("GET", url, "/weight_info")
        check_forward(url, held.get("weight_version") if isinstance(held, dict) else None, version, rollback=rollback)
        for path, body in weight_push_calls(model_path, version):
            request("POST", url, path, body)
