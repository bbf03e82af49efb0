"""The generation service's settings (`python -m drgrpo_jax.serve`): one frozen typed dataclass whose fields carry
their default and their one help text, as the run config's sections do (`schema._f`). The service's flags are
made from the fields (`add_flags`, through `flags.add_field_flag`) and its YAML is read through the run config's
typed merge (`load_serve_config`), so a setting is declared once. Every limit: docs/serving-limits.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from drgrpo_jax.config.flags import add_field_flag
from drgrpo_jax.config.load import read_config_file, translate_error
from drgrpo_jax.config.schema import _f
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.models.precision import DTYPES
from drgrpo_jax.sharding import SERVICE_MESH_EXAMPLE, parse_service_mesh
from drgrpo_jax.weight_folders import is_remote

__all__ = ["DEFAULT_MAX_BATCH_SIZE", "LIMITS", "LOOPBACK_NAMES", "REMOTE_SCHEMES", "ServeConfig", "add_flags",
           "clean_remote", "is_loopback", "load_serve_config", "normalize_roots"]

DEFAULT_MAX_BATCH_SIZE = 32  # --max-batch-size unless given (the plan assumes it for rollout.urls' services)
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
REMOTE_SCHEMES = ("gs://", "file://")  # URI schemes a weight root may name: a bucket prefix (file:// in tests)
LIMITS = "limits"  # the `group` of the flags docs/serving-limits.md describes

# Field metadata beyond `help` (all optional): `flag` the option's name (default --the-field-name; None: a YAML
# key only), `metavar`, `choices`, `group` (LIMITS), `hidden` (the launcher's own flags: accepted, not shown).


def is_loopback(host: str) -> bool:
    """Whether binding to `host` keeps the service on this machine."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def clean_remote(path: str) -> str | None:
    """`scheme://rest` with no empty, `.` or `..` segment, else None."""
    scheme, _, rest = path.partition("://")
    parts = rest.split("/")
    if not scheme or any(p in ("", ".", "..") for p in parts[:-1]) or parts[-1] in (".", ".."):
        return None
    return f"{scheme}://{rest.rstrip('/')}"


def normalize_roots(roots: Sequence[str]) -> tuple[str, ...]:
    """Roots as compared: local ones absolute with symlinks resolved, bucket prefixes cleaned; ValueError if bad."""
    out = []
    for root in roots:
        if is_remote(root):
            clean = clean_remote(root)
            if clean is None or not root.startswith(REMOTE_SCHEMES):
                raise ValueError(f"weights_roots: {root!r} is neither a local folder nor a gs://bucket/prefix")
            out.append(clean)
        else:  # as resolved, and as written when a symbolic link leads to it (clients send either)
            out += dict.fromkeys((os.path.realpath(os.path.abspath(root)), os.path.normpath(os.path.abspath(root))))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """How the service loads its model, binds, authenticates and batches requests."""

    model: str = _f("", "HF folder or .gguf file to serve, or a PEFT LoRA adapter folder (served on the base its "
                        "adapter_config.json names)")
    host: str = _f("127.0.0.1", "bind address; beyond loopback a key is required")
    port: int = _f(30000, "TCP port (30000 is SGLang's); 0 = any free port")
    port_file: str = _f("", "write the bound port here once serving (for a parent that asked for port 0)",
                        hidden=True)
    parent_pid: int = _f(0, "shut down when this process is gone (set by the trainer's child-service launcher); "
                            "0 = off", hidden=True)
    dtype: str = _f("float32", "parameter and KV-cache dtype", choices=sorted(DTYPES))
    mesh: str = _f("", "run the sampler over T x D of this host's devices: weights and KV cache split over heads, "
                       "MLP and vocabulary on tensor (the trainer's rules), rows on data; only the order of float sums "
                       f"changes (e.g. {SERVICE_MESH_EXAMPLE}; default: one device)",
                   metavar="tensor=T[,data=D]")
    weight_version: str = _f("0", "version reported until the first weight update")
    inflight_updates: bool = _f(False, "a weight update reaches the batches already running at their next decode "
                                       "phase or --cancel-check-steps pause (the tokens sampled so far stay in the "
                                       "KV cache), and /generate reports the version of every output token "
                                       "(meta_info.output_token_weight_versions); off: a batch samples on one "
                                       "version")
    max_batch_size: int = _f(DEFAULT_MAX_BATCH_SIZE, "rows (prompts x n) per sampler call")
    batch_wait_ms: float = _f(5.0, "after a request, wait this long for others to batch with it")
    max_context: int = _f(0, "prompt + new tokens limit (default: the model's max_position_embeddings)")
    tokenizer: str = _f("", "tokenizer folder (default: the model's own; without one only token-id prompts are "
                            "served)", metavar="DIR")
    api_key_env: str = _f("", "every route but GET /health needs 'Authorization: Bearer <the value of $NAME>' (the "
                              "key itself never goes on the command line, which `ps` shows)", metavar="NAME")
    admin_key_env: str = _f("", "a separate key (in $NAME) that alone may call /update_weights_from_disk",
                            metavar="NAME")
    allow_unauthenticated: bool = _f(False, "serve beyond loopback without a key (only on a network you trust)")
    weights_roots: tuple[str, ...] = _f((), "weight updates load only from folders under DIR, with no symbolic "
                                            "link below it (repeatable; gs://bucket/prefix too)",
                                        flag="--weights-root", metavar="DIR")
    max_request_tokens: int = _f(2**23, "per request: prompts x n x (prompt + new tokens)", group=LIMITS)
    max_batch_bytes: int = _f(0, "sampler memory a batch may take on a device beside the weights (its KV cache and "
                                 "the prefill's or decode loop's temporaries, estimated before it runs); batches are "
                                 "cut to fit, a prompt that alone does not fit is refused (400), and log-prob "
                                 "scoring runs as many rows a call as fit; 0 = half the device's free memory once "
                                 "the weights are loaded", group=LIMITS)
    prefix_cache_bytes: int = _f(0, "device memory (one device) kept for prompts' KV blocks across requests: a "
                                     "prompt that starts with a cached prefix prefills only the rest; least recently "
                                     "used blocks go when it is full, and a weight update empties it; -1 = a quarter "
                                     "of the batch budget (--max-batch-bytes or its default), 0 = off (the default: "
                                     "cached log-probs match a whole prefill to float rounding, not bit for bit, so a "
                                     "sampled token can differ and a row would depend on what others cached)",
                                 group=LIMITS)
    max_queued_tokens: int = _f(2**24, "that measure over every request queued or running; beyond it: 429",
                                group=LIMITS)
    max_body_bytes: int = _f(32 * 2**20, "largest request body, however it is sent (413 beyond)", group=LIMITS)
    default_max_tokens: int = _f(512, "new tokens of a chat completion that names no max_tokens", group=LIMITS)
    max_tokens_limit: int = _f(8192, "OpenAI routes: a larger max_tokens / max_completion_tokens is refused",
                               group=LIMITS)
    request_timeout_s: float = _f(600.0, "a request is answered by then: what was sampled, the rest with finish "
                                         "reason abort", group=LIMITS)
    admission_share: float = _f(0.5, "a request whose new tokens would hold a batch longer than this share of "
                                     "--request-timeout-s at the service's decoding speed is refused (400, naming "
                                     "both), so one request cannot hold the workers and the queue for its whole "
                                     "deadline (requests of many batches take turns a batch at a time); 0 = off",
                                group=LIMITS, metavar="SHARE")
    admission_tokens_per_second: float = _f(0.0, "the decoding speed (new tokens a second, one row) that "
                                                 "--admission-share assumes; 0 = the fastest batch served so far "
                                                 "that compiled nothing (nothing is refused before one)",
                                            group=LIMITS, metavar="N")
    max_scoring_bytes: int = _f(256 * 2**20, "log-prob scoring's float32 temporaries per tile of positions x "
                                             "vocabulary", group=LIMITS)
    header_timeout_s: float = _f(10.0, "a connection must send its request's headers within this (408 after)",
                                 group=LIMITS)
    body_timeout_s: float = _f(30.0, "a request's body must arrive within this (408 after)", group=LIMITS)
    keep_alive_s: float = _f(5.0, "an idle kept-alive connection is closed after this long", group=LIMITS)
    max_connections: int = _f(256, "open connections beyond this are answered 503 and closed", group=LIMITS)
    max_header_bytes: int = _f(16 * 2**10, "request line + headers beyond this: 400 and the connection closed",
                               group=LIMITS)
    cancel_check_steps: int = _f(32, "a running batch asks every this many decode steps whether its rows' clients "
                                     "are still there; the others stop there", group=LIMITS)
    max_kept_programs: int = _f(0, "when the service goes idle holding more compiled sampler programs than this "
                                   "(one set per new batch shape, each holding host memory), it drops every "
                                   "compiled program and compiles again as shapes return; 0 = keep all (all go anyway "
                                   "past half the process's memory-mapping limit)",
                                group=LIMITS)
    short_request_tokens: int = _f(64, "requests of one batch asking for at most this many new tokens have their "
                                       "own worker: they never wait behind a long batch (0 = off)", group=LIMITS)
    continuous_admission: bool = _f(False, "queued rows join a running batch at its decode phase or "
                                           "--cancel-check-steps pause, in finished rows' places or rows it grows by "
                                           "(within --max-batch-size and --max-batch-bytes; prompts within its prompt "
                                           "length, budgets within its new tokens), and every row is answered at "
                                           "the pause after it finishes; a row's tokens are the same either way")
    max_rows_per_request: int = _f(4096, "prompts x n accepted in one request", flag=None)
    served_model_name: str = _f("", "the model's name in responses (/v1/models, /get_model_info); empty = the "
                                    "Hub id as given, or the model folder's name (never a server path)", flag=None)

    def __post_init__(self):
        if isinstance(self.weights_roots, (list, str)):
            roots = [self.weights_roots] if isinstance(self.weights_roots, str) else self.weights_roots
            object.__setattr__(self, "weights_roots", tuple(roots))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not supported (supported: {sorted(DTYPES)})")
        for name in ("max_batch_size", "max_rows_per_request", "max_request_tokens", "max_queued_tokens",
                     "max_body_bytes", "default_max_tokens", "max_tokens_limit", "max_scoring_bytes",
                     "max_connections", "max_header_bytes", "cancel_check_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout_s", "header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name}: must be a positive number of seconds, got {getattr(self, name)}")
        for name in ("short_request_tokens", "max_kept_programs", "max_batch_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.prefix_cache_bytes < -1:
            raise ValueError(f"prefix_cache_bytes: must be >= 0, or -1 for a quarter of the batch budget, got "
                             f"{self.prefix_cache_bytes}")
        if not 0 <= self.admission_share < math.inf or not 0 <= self.admission_tokens_per_second < math.inf:
            raise ValueError("admission_share, admission_tokens_per_second: must be finite and >= 0")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(f"default_max_tokens: {self.default_max_tokens} exceeds max_tokens_limit="
                             f"{self.max_tokens_limit}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.batch_wait_ms < 0 or self.max_context < 0:
            raise ValueError("batch_wait_ms, max_context: must be >= 0")
        normalize_roots(self.weights_roots)  # a malformed root fails here, at start-up
        parse_service_mesh(self.mesh, "mesh")
        if not is_loopback(self.host) and not self.api_key_env and not self.allow_unauthenticated:
            raise ValueError(f"host: {self.host} is reachable from other machines, so the service needs a key "
                             "(--api-key-env NAME, the key in that environment variable); "
                             "--allow-unauthenticated serves without one")

    @property
    def loopback(self) -> bool:
        """Whether the service is bound to this machine only."""
        return is_loopback(self.host)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """ServeConfig's fields as flags (`flags.add_field_flag`): each defaults to None (not given: the YAML's value or
    the field's default), `--weights-root` repeats into weights_roots, the `limits` group is its own section of
    --help."""
    limits = parser.add_argument_group("limits (docs/serving-limits.md)")
    for field in dataclasses.fields(ServeConfig):
        if field.metadata.get("group") == LIMITS:
            metavar = field.metadata.get("metavar") or ("SECONDS" if isinstance(field.default, float) else "N")
            add_field_flag(limits, ServeConfig, field.name, given_only=True, metavar=metavar)
        else:
            add_field_flag(parser, ServeConfig, field.name, given_only=True)


@dataclasses.dataclass(frozen=True)
class _ServeFile:
    """A YAML's `serve:` section, typed, so that a bad key is named serve.<key>."""

    serve: ServeConfig = dataclasses.field(default_factory=ServeConfig)


def _serve_fields(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(ServeConfig if section == "serve" else _ServeFile)]


def _typed(values: dict[str, Any], where: str) -> dict[str, Any]:
    """`values` over the defaults through OmegaConf's typed merge; an unknown key or a wrong type is a
    ConfigError naming serve.<key>."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(_ServeFile), {"serve": values})
        typed = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as error:
        raise translate_error(error, where, _serve_fields) from None
    assert isinstance(typed, dict)
    return typed["serve"]


def load_serve_config(path: str | None, flags: Mapping[str, Any]) -> ServeConfig:
    """ServeConfig from a YAML file (None: none) and the flags given (None or [] = not given), flags winning.

    The YAML is a trainer config, whose `model` section gives model, dtype and tokenizer, with an optional `serve:`
    section of ServeConfig's fields; or those fields alone. A service beyond loopback started from a trainer config
    loads weight pushes only from its run's weights folder unless weights_roots are given.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        try:  # resolved whole: a serve: value may name another section's (${run.output_dir})
            loaded = OmegaConf.to_container(read_config_file(path), resolve=True)
        except OmegaConfBaseException as error:
            raise translate_error(error, f" in {path}", _serve_fields) from None
        assert isinstance(loaded, dict)
        raw = {str(k): v for k, v in loaded.items()}
    model = raw.get("model")
    trainer = isinstance(model, dict)
    section = raw.get("serve", {} if trainer else raw) or {}
    if not isinstance(section, dict):
        raise ConfigError("serve", f"must be a mapping of fields, got {section!r} in {path}")
    inherited = {"model": model.get("path") or "", "dtype": model.get("dtype") or "float32",
                 "tokenizer": model.get("tokenizer_path") or ""} if isinstance(model, dict) else {}
    values = _typed({**inherited, **section}, f" in {path}") if raw else {}
    given = {k: v for k, v in flags.items() if v is not None and v != []}
    values.update(given)
    if trainer and not is_loopback(values["host"]) and "weights_roots" not in {**section, **given}:
        run = raw["run"] if isinstance(raw.get("run"), dict) else {}
        # Beyond loopback, a trainer config names where its weight versions go: pushes load from there only.
        values["weights_roots"] = [run.get("weights_dir") or os.path.join(run.get("output_dir") or "runs/default",
                                                                          "weights")]
    return ServeConfig(**values)
