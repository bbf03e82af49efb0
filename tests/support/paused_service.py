"""`python tests/support/paused_service.py SERVE-ARGS...`: the generation service (drgrpo_jax.serve), each of whose
batches pauses at its second --cancel-check-steps question until the served weights change (at most PAUSE_S): with
--inflight-updates, a trainer's push then reaches a round mid-decode on every step, not only when timing allows."""

import sys
import time

from drgrpo_jax.serve.cli import main
from drgrpo_jax.serve.scheduler import Scheduler

PAUSE_S = 5.0
_run_batch = Scheduler.run_batch


def _paused_run_batch(self, weights, rows, unwanted=None):
    questions = []

    def ask() -> list[bool]:
        questions.append(1)
        if len(questions) == 2:
            deadline = time.monotonic() + PAUSE_S
            while self.weights is weights and time.monotonic() < deadline:
                time.sleep(0.01)
        return unwanted() if unwanted is not None else [False] * len(rows)

    return _run_batch(self, weights, rows, unwanted=ask)


Scheduler.run_batch = _paused_run_batch  # type: ignore[method-assign]
main(sys.argv[1:])
