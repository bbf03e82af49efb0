"""SGLang's native HTTP API as an engine (`rollout.engine=sglang`): `/generate`, `/update_weights_from_disk`.

SGLang copies one request row's `sampling_seed` into all `n` copies of it, so each completion is its own row with its
own seed (`seeds.completion_seeds`). It honours seeds only when started with --enable-deterministic-inference, which
`check_startup` reads from the server's settings: a server that does not say so is taken to ignore them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, ClassVar

from drgrpo_jax.config.engines import EngineName
from drgrpo_jax.errors import RolloutError
from drgrpo_jax.rollout.engines.base import Call, Engine, Request, Sampling, json_object
from drgrpo_jax.seeds import completion_seeds

log = logging.getLogger("drgrpo_jax.rollout")
__all__ = ["SGLangEngine", "server_info"]


class SGLangEngine(Engine):
    """A real SGLang server: one request row per completion."""

    name: ClassVar[EngineName] = "sglang"
    one_row_per_completion: ClassVar[bool] = True  # else one row per prompt with n = G

    def generate_calls(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], shares: Sequence[Sequence[int]],
                       group_size: int, sampling: Sampling) -> list[Call]:
        """One /generate call per share, holding its prompts' rows."""
        return [Call(k, "/generate", self._generate_body(prompts, seeds, share, group_size, sampling), tuple(share))
                for k, share in enumerate(shares)]

    def _generate_body(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], share: Sequence[int],
                       group_size: int, sampling: Sampling) -> dict[str, Any]:
        """The /generate body of the prompts of `share`, each G times."""
        rows = [(i, s) for i in share for s in (
            completion_seeds(seeds[i], group_size) if self.one_row_per_completion else [seeds[i]])]
        params = [{"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                   "top_p": sampling.top_p, "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                   "n": 1 if self.one_row_per_completion else group_size, "sampling_seed": seed,
                   "stop_token_ids": list(sampling.stop_token_ids),
                   **({"ignore_eos": True} if sampling.ignore_eos else {})} for _, seed in rows]
        return {"input_ids": [list(map(int, prompts[i])) for i, _ in rows], "sampling_params": params,
                "return_logprob": True, **({"return_routed_experts": True} if sampling.routed_experts else {})}

    def check_startup(self, url: str, request: Request) -> bool:
        """Whether the server says it runs with --enable-deterministic-inference (ServerArgs' field); a warning when
        it does not."""
        if server_info(url, request).get("enable_deterministic_inference") is True:
            return True
        log.warning("rollout.engine=%s: %s does not run with --enable-deterministic-inference, so it ignores sampling "
                    "seeds and its rollouts cannot be reproduced (docs/engines.md)", self.name, url)
        return False

    def push_weights(self, url: str, model_path: str, version: str, rollback: bool, request: Request) -> None:
        """SGLang's /update_weights_from_disk."""
        body: dict[str, Any] = {"model_path": model_path, "weight_version": version}
        if rollback:  # only then: a stand-in SGLang server never sees our service's extension
            body["allow_rollback"] = True
        answer = json_object(request("POST", url, "/update_weights_from_disk", body),
                             f"{url}/update_weights_from_disk: the answer")
        if answer.get("success") is not True:
            raise RolloutError(f"{url}/update_weights_from_disk: {answer.get('message')}", url=url)


def server_info(url: str, request: Request) -> dict[str, Any]:
    """SGLang's ServerArgs as its server reports them (/server_info, or /get_server_info before SGLang renamed it);
    {} when it has neither route."""
    for path in ("/server_info", "/get_server_info"):
        try:
            info = request("GET", url, path)
        except RolloutError as error:
            if error.status == 404:
                continue
            raise
        return info if isinstance(info, dict) else {}
    return {}
