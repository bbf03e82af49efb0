"""`python -m drgrpo_jax.train --config PATH [section.key=value ...]`: exit codes and one-line errors."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import traceback

from drgrpo_jax.checkpoint import RESTART_EXIT_CODE
from drgrpo_jax.config.load import config_from_argv
from drgrpo_jax.config.rules import check_output_dir
from drgrpo_jax.errors import ConfigError, Preempted
from drgrpo_jax.train.loop import train
from drgrpo_jax.weight_folders import write_text

__all__ = ["PROG", "main"]


PROG = "python -m drgrpo_jax.train"


def main(argv: list[str] | None = None) -> int:
    """The CLI: a bad config, path, task or URL exits 2, a failed run 1 and a preempted one (saved, to be
    relaunched) RESTART_EXIT_CODE (42), each with one line on stderr."""
    config = config_from_argv(argv, prog=PROG)  # exits 2 itself on a bad config
    command = shlex.join([*PROG.split(), *(sys.argv[1:] if argv is None else argv)])  # for the model card
    try:
        check_output_dir(config.run)
        train(config, command)
    except ConfigError as error:
        print(f"{PROG}: config error: {error}", file=sys.stderr)
        return 2
    except Preempted as error:  # saved on every process: the launchers relaunch on this code, and it resumes
        print(f"{PROG}: {error}", file=sys.stderr)
        return RESTART_EXIT_CODE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; resume with the same command (train.resume=true)", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - one line here; the whole traceback goes to error.log
        log_path = os.path.join(config.run.output_dir, "error.log")
        with contextlib.suppress(OSError):  # a bucket too: written whole
            write_text(log_path, traceback.format_exc())
        message = (str(error).strip().splitlines() or [""])[0][:500]  # e.g. a service's log tail stays in error.log
        print(f"{PROG}: {type(error).__name__}: {message} (traceback in {log_path})", file=sys.stderr)
        return 1
    return 0
