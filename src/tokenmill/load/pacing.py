"""Where the default Loader assembles batches: inline on the training thread, or ahead on a worker.

Handing a batch over from a background thread costs about 150 µs on a 2-core VM (issue 16; the
Loader measures it once per process at run time, ``handoff_cost``), while a warm concat batch of
8 × 2048 tokens is built in about 20 µs: ahead only pays when assembling costs
more than the hand-off *and* waiting for it inline would show in the step (cold pages, remote
shards, packed rows with many segments, a short step). So the Pacer starts inline, and from
measured times (assembly of each batch, the consumer's time between batches) moves ahead after a
few costly batches with a step to hide them behind and back inline after a long cheap window, or
as soon as the consumer's waits for batches from the worker cost more than assembling inline did
(the worker contends with the step for the GIL: a hand-off can cost far more than an idle round
trip, and that wait is then the hand-off cost the Pacer goes by); ``reason`` says why, in numbers::

    pacer = Pacer()
    pacer.observe(assemble_s=0.004, step_s=0.020)   # ... after GO_AHEAD such steps:
    pacer.mode == "ahead"

The Pacer is pure bookkeeping: the Loader does the switching (the order of batches never depends
on it) and measures the hand-off once per process (``handoff_cost``).
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["AHEAD_TRIAL", "GO_AHEAD", "GO_INLINE", "HANDOFF_HOW", "HANDOFF_MARGIN", "HANDOFF_ROUNDS", "HANDOFF_S", "Pacer", "WAIT_FRACTION",
           "handoff_cost", "round_trip_s"]

HANDOFF_S = 150e-6  # assumed hand-off cost until measured (issue 16's VM)
HANDOFF_ROUNDS = 7  # round trips measured (after one that starts the worker): their median
HANDOFF_HOW = f"median of {HANDOFF_ROUNDS} round trips to the worker thread, once per process"
WAIT_FRACTION = 0.01  # inline assembly above 1% of a step shows as data wait
GO_AHEAD = 3  # costly batches in a row before moving ahead (cold pages show at once)
GO_INLINE = 50  # cheap batches in a row before coming back inline (no flapping)
AHEAD_TRIAL = 8  # batches ahead before their waits are compared with assembling inline
# an idle round trip understates a hand-off while the step holds the GIL (0.2-1.8 ms waits were
# seen for a 22 µs round trip): going ahead needs batches costlier than this many round trips
HANDOFF_MARGIN = 4

_measured: dict[str, float] = {}  # worker kind -> seconds, measured once per process


def round_trip_s(submit: Callable[[Callable[[], None]], Future], rounds: int) -> float:
    """Median seconds of ``rounds`` round trips of an empty task through ``submit`` (e.g. a
    ThreadPoolExecutor's), after one that starts the worker."""
    submit(_nothing).result()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        submit(_nothing).result()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def handoff_cost(submit: Callable[[Callable[[], None]], Future], kind: str = "thread") -> float:
    """Seconds a hand-off to a background worker of ``kind`` costs a batch here: measured once
    per process (``round_trip_s``), then cached."""
    if kind not in _measured:
        _measured[kind] = round_trip_s(submit, HANDOFF_ROUNDS)
    return _measured[kind]


def _nothing() -> None:
    return None


@dataclass
class Pacer:
    """Inline or ahead, decided from measured assemble and step times; ``stats()`` reports it."""

    mode: str = "inline"
    reason: str = "start: a batch is assembled inline until measurements show that is costly"
    switches: int = 0
    streak: int = 0  # batches in a row that argue for the other mode
    assemble_s: float = 0.0  # exponential means (weight 1/8) of the last batches
    step_s: float = 0.0
    handoff_s: float = HANDOFF_S  # what a hand-off costs a batch: assumed until ``measured``
    handoff: str = "assumed"
    inline_s: float = 0.0  # mean assembly inline when it last went ahead
    wait_s: float = 0.0  # mean wait for a batch from the worker, while ahead
    seen: int = field(default=0, repr=False)
    ahead_seen: int = field(default=0, repr=False)

    def measured(self, handoff_s: float, how: str) -> None:
        """Use a hand-off cost measured at run time (``how`` says how) from now on."""
        self.handoff_s, self.handoff = handoff_s, f"measured: {how}"

    def observe(self, *, assemble_s: float, step_s: float, wait_s: float | None = None) -> bool:
        """Record one batch (its assembly, the consumer's time since the last, and — ahead — the
        time the consumer waited for it); True on a switch."""
        self.seen += 1
        if self.seen == 1:  # the first batch maps shards and builds caches: not typical
            self.assemble_s, self.step_s = assemble_s, step_s
            return False
        self.assemble_s += (assemble_s - self.assemble_s) / 8
        self.step_s += (step_s - self.step_s) / 8
        if self.mode == "inline":
            # ahead hides at most the step: with no step to hide behind (a loop that only draws
            # batches) a hand-off is pure cost
            costly = min(assemble_s, step_s) > HANDOFF_MARGIN * self.handoff_s and \
                assemble_s > WAIT_FRACTION * (assemble_s + step_s)
            self.streak = self.streak + 1 if costly else 0
            if self.streak >= GO_AHEAD:
                self.inline_s, self.ahead_seen = self.assemble_s, 0
                return self._switch("ahead", f"assembling took {assemble_s * 1e3:.2f} ms a "
                                    f"batch inline ({self._share(assemble_s):.1%} of a step), "
                                    f"more than {HANDOFF_MARGIN} hand-offs of "
                                    f"{self.handoff_s * 1e6:.0f} µs")
            return False
        return self._ahead(wait_s)

    def _ahead(self, wait_s: float | None) -> bool:
        if wait_s is not None:  # the hand-off's real cost here: what the consumer waits for
            self.ahead_seen += 1
            self.wait_s = wait_s if self.ahead_seen == 1 else \
                self.wait_s + (wait_s - self.wait_s) / 8
            if self.ahead_seen >= AHEAD_TRIAL and self.wait_s > max(self.inline_s,
                                                                    self.handoff_s):
                self.handoff_s, self.handoff = self.wait_s, ("measured: the wait for a batch "
                                                             "from the worker while ahead")
                return self._switch("inline", f"waiting for the worker took "
                                    f"{self.wait_s * 1e6:.0f} µs a batch ahead, more than "
                                    f"assembling inline ({self.inline_s * 1e6:.0f} µs)")
        cheap = self.assemble_s < self.handoff_s / 2
        self.streak = self.streak + 1 if cheap else 0
        if self.streak >= GO_INLINE:
            return self._switch("inline", f"assembling takes {self.assemble_s * 1e3:.3f} ms a "
                                f"batch, less than half a {self.handoff_s * 1e6:.0f} µs hand-off")
        return False

    def _share(self, assemble_s: float) -> float:
        return assemble_s / max(assemble_s + self.step_s, 1e-9)

    def _switch(self, mode: str, reason: str) -> bool:
        self.mode, self.reason, self.streak = mode, reason, 0
        self.switches += 1
        return True

    def stats(self) -> dict:
        """Mode, why, switches so far, mean assemble and step milliseconds, the hand-off cost
        the decisions use (µs) and whether it was measured or assumed."""
        return {"mode": self.mode, "why": self.reason, "switches": self.switches,
                "assemble_ms": round(self.assemble_s * 1e3, 4),
                "step_ms": round(self.step_s * 1e3, 4),
                "handoff_us": round(self.handoff_s * 1e6, 1), "handoff": self.handoff,
                "ahead_wait_ms": round(self.wait_s * 1e3, 4)}
