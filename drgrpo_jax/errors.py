"""The error types of drgrpo_jax, raised where the failure is known and caught by type, never by message.

Imports nothing else of ours, so the math (losses, algorithms), the step and the host code can all
raise them: library values refused at construction (`FieldError`), run config values (`ConfigError`),
rewards (`RewardError`), the generation service (`RolloutError`), other hosts (`HostFailure`), the service's
requests and weights, and the tools an episode calls.
"""

from __future__ import annotations

__all__ = [
    "BadRequest",
    "CalculatorError",
    "ClientGone",
    "ConfigError",
    "CorruptCheckpoint",
    "FieldError",
    "FieldTypeError",
    "HostFailure",
    "InvalidWeights",
    "MissingValueError",
    "PackingError",
    "PathNotAllowed",
    "Preempted",
    "PythonToolError",
    "QueueFull",
    "RewardError",
    "RolloutError",
    "StaleWeightsError",
    "ToolArgumentError",
    "UnsafeSegment",
]


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


class FieldError(ValueError):
    """A library value refused at construction: `owner.field: reason` (e.g. `LossConfig.clip_low: ...`).

    `.owner` and `.field` name it as the library does, so the run config maps it to its own dotted key without
    reading the message.
    """

    def __init__(self, owner: str, field: str, reason: str):
        self.owner, self.field, self.reason = owner, field, _one_line(reason)
        super().__init__(f"{owner}.{field}: {self.reason}")

    def __reduce__(self):  # pickles across processes with its fields
        return type(self), (self.owner, self.field, self.reason)


class FieldTypeError(FieldError, TypeError):
    """A library value of the wrong type (a TypeError and a FieldError)."""


class ConfigError(ValueError):
    """A bad config value: the message is one line, `dotted.key: reason`."""

    def __init__(self, key: str, reason: str):
        self.key = key
        self.reason = _one_line(reason)  # one line, whatever the source message
        super().__init__(f"{key}: {self.reason}")

    def __reduce__(self):
        return type(self), (self.key, self.reason)


class MissingValueError(ConfigError):
    """A config value the run needs is not set (e.g. model.path)."""


class PackingError(ConfigError):
    """A window's responses do not fit the packed rows: `key` is train.pack_rows or train.pack_length."""


class RewardError(RuntimeError):
    """A reward that cannot be trusted (NaN/inf) or a worker that cannot start: the run stops."""


class RolloutError(RuntimeError):
    """The generation service could not produce the rollout; `status`: its HTTP status, when it answered one
    (None: no answer, or not an HTTP failure); `url`: the service."""

    def __init__(self, message: str, *, status: int | None = None, url: str | None = None):
        self.status, self.url = status, url
        super().__init__(message)


class StaleWeightsError(RolloutError):
    """Completions came from weights other than the ones the trainer expects."""


class BadRequest(Exception):
    """A request the generation service refuses (HTTP 400); the message names the field and the reason."""


class ClientGone(Exception):
    """The client disconnected while its rows were queued or running (nobody reads the answer)."""


class QueueFull(Exception):
    """The service's queue holds max_queued_tokens of work already (HTTP 429); `retry_after_s`: when to try again."""

    def __init__(self, retry_after_s: int):
        self.retry_after_s = retry_after_s
        super().__init__(f"the service is busy: retry in {retry_after_s} s")

    def __reduce__(self):
        return type(self), (self.retry_after_s,)


class CorruptCheckpoint(ValueError):
    """A checkpoint's array read back differs from the checksum saved with it."""


class InvalidWeights(ValueError):
    """A weight update the service refuses; the message is safe to show a client (no file-system detail)."""


class UnsafeSegment(ValueError):
    """A shared-memory weight segment that is not a fresh, private, regular file of this user's: a name already
    taken (a planted link or folder), a folder or file another user owns or may write, a symbolic link."""


class PathNotAllowed(Exception):
    """A weight path outside every --weights-root (HTTP 403); the message names the rule, never the disk."""


class HostFailure(RuntimeError):
    """`what` failed on process `process` with an error of type `kind`; this process stops with it."""

    def __init__(self, what: str, process: int, kind: str):
        self.what, self.process, self.kind = what, process, kind
        super().__init__(f"{what} failed on process {process} ({kind}; see its log)")

    def __reduce__(self):
        return type(self), (self.what, self.process, self.kind)


class Preempted(Exception):
    """The run was preempted (SIGTERM, or another process's notice) and saved `step` on every process; the same
    command resumes it (`python -m drgrpo_jax.train` exits with checkpoint.RESTART_EXIT_CODE)."""

    def __init__(self, step: int):
        self.step = step
        super().__init__(f"preempted: saved step {step}; relaunch the same command to resume")

    def __reduce__(self):
        return type(self), (self.step,)


class ToolArgumentError(ValueError):
    """A tool call's arguments do not fit the tool's schema (the model's mistake: it becomes an error message)."""


class CalculatorError(ValueError):
    """An expression the calculator refuses: not arithmetic, too large, or dividing by zero."""


class PythonToolError(RuntimeError):
    """The python tool's code failed or hit a limit; the message is what the model is told."""


class PythonSandboxUnavailable(RuntimeError):
    """The python tool's jail cannot start here (no bwrap, user namespaces or libseccomp): the message says why."""
