"""The pack-ahead thread: one long-lived background thread packs, for every packed plan, the
window after the one its loader reads, so that the loader finds it packed.

One thread for the process (``base.io.BackgroundJobs``), not one a window: starting a thread
cost the training loop's thread a GIL round trip each time (hundreds of µs on a VM). The
interpreter's exit waits for a window being packed (``finish``); a forked child starts afresh,
and every plan made here is told (``PackedPlan.after_fork``: what the parent's thread was
packing is packed again when asked for)::

    packahead.track(plan); packahead.submit(lambda: plan.window_rows(0, 1))
"""

from __future__ import annotations

import atexit
from typing import Callable

from tokenmill.base.io import BackgroundJobs
from tokenmill.base.procs import after_fork

__all__ = ["finish", "submit", "track"]

JOBS = BackgroundJobs("tokenmill-pack-ahead")


def track(plan) -> None:
    """``plan.after_fork()`` now and in each forked child of this process (procs.after_fork)."""
    after_fork(plan)


def submit(job: Callable[[], None]) -> None:
    """Run ``job()`` on the pack-ahead thread, after the jobs queued before it."""
    JOBS.submit(lambda cancel: job())


@atexit.register
def finish() -> None:
    """Let the pack-ahead thread end before the interpreter does: one still inside numpy's sorts
    (C++, the GIL released) when Python finalizes is torn down by pthread_exit through C++
    frames, and the process aborts ("terminate called without an active exception")."""
    JOBS.close(wait=60.0)
