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
import os
import weakref
from typing import Any, Callable

from tokenmill.base.io import BackgroundJobs

__all__ = ["finish", "submit", "track"]

JOBS = BackgroundJobs("tokenmill-pack-ahead")
_PLANS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def track(plan) -> None:
    """Call ``plan.after_fork()`` in a forked child of this process."""
    _PLANS.add(plan)


def submit(job: Callable[[], None]) -> None:
    """Run ``job()`` on the pack-ahead thread, after the jobs queued before it."""
    JOBS.submit(lambda cancel: job())


@atexit.register
def finish() -> None:
    """Let the pack-ahead thread end before the interpreter does: one still inside numpy's sorts
    (C++, the GIL released) when Python finalizes is torn down by pthread_exit through C++
    frames, and the process aborts ("terminate called without an active exception")."""
    JOBS.close(wait=60.0)


def _forked() -> None:
    for plan in list(_PLANS):
        plan.after_fork()


os.register_at_fork(after_in_child=_forked)
