"""The one rule for the generation services' API key, which the trainer (`rollout.api_key_env`) and the evaluator
(`--api-key-env`) both read: the key lives in an environment variable, never on a command line, which `ps` shows.
"""

from __future__ import annotations

import os

from drgrpo_jax.errors import ConfigError

__all__ = ["api_key"]


def api_key(env_name: str, key: str = "rollout.api_key_env") -> str | None:
    """The key held by the environment variable `env_name` (empty name: None, no key); a ConfigError naming `key`,
    the setting that named the variable, when it is unset or blank: a key asked for is never silently dropped."""
    if not env_name:
        return None
    value = os.environ.get(env_name, "").strip()
    if not value:
        raise ConfigError(key, f"environment variable {env_name} is not set or empty")
    return value
