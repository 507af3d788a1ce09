"""Where the default Loader assembles batches: inline on the training thread, or ahead on a worker.

Handing a batch over from a background thread costs about 150 µs on a 2-core VM, while a warm
concat batch of 8 × 2048 tokens is built in about 30 µs: ahead only pays when assembling costs
more than the hand-off *and* waiting for it inline would show in the step (cold pages, remote
shards, packed rows with many segments, a short step). So the Pacer starts inline, and from
measured times (assembly of each batch, the consumer's time between batches) moves ahead after a
few costly batches with a step to hide them behind and back inline after a long cheap window; ``reason`` says why, in numbers::

    pacer = Pacer()
    pacer.observe(assemble_s=0.004, step_s=0.020)   # ... after GO_AHEAD such steps:
    pacer.mode == "ahead"

Pure bookkeeping: the Loader does the switching (the order of batches never depends on it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GO_AHEAD", "GO_INLINE", "HANDOFF_S", "Pacer", "WAIT_FRACTION"]

HANDOFF_S = 150e-6  # seconds a background hand-off costs a batch (measured, issue 16)
WAIT_FRACTION = 0.01  # inline assembly above 1% of a step shows as data wait
GO_AHEAD = 3  # costly batches in a row before moving ahead (cold pages show at once)
GO_INLINE = 50  # cheap batches in a row before coming back inline (no flapping)


@dataclass
class Pacer:
    """Inline or ahead, decided from measured assemble and step times; ``stats()`` reports it."""

    mode: str = "inline"
    reason: str = "start: a batch is assembled inline until measurements show that is costly"
    switches: int = 0
    streak: int = 0  # batches in a row that argue for the other mode
    assemble_s: float = 0.0  # exponential means (weight 1/8) of the last batches
    step_s: float = 0.0
    seen: int = field(default=0, repr=False)

    def observe(self, *, assemble_s: float, step_s: float) -> bool:
        """Record one batch (its assembly, the consumer's time since the last); True on a switch."""
        self.seen += 1
        if self.seen == 1:  # the first batch maps shards and builds caches: not typical
            self.assemble_s, self.step_s = assemble_s, step_s
            return False
        self.assemble_s += (assemble_s - self.assemble_s) / 8
        self.step_s += (step_s - self.step_s) / 8
        # ahead hides at most the step: with no step to hide behind (a loop that only draws
        # batches) a hand-off is pure cost
        costly = min(assemble_s, step_s) > HANDOFF_S and \
            assemble_s > WAIT_FRACTION * (assemble_s + step_s)
        if self.mode == "inline":
            self.streak = self.streak + 1 if costly else 0
            if self.streak >= GO_AHEAD:
                return self._switch("ahead", f"assembling took {assemble_s * 1e3:.2f} ms a "
                                    f"batch inline ({self._share(assemble_s):.1%} of a step), "
                                    f"more than a {HANDOFF_S * 1e6:.0f} µs hand-off")
            return False
        cheap = self.assemble_s < HANDOFF_S / 2
        self.streak = self.streak + 1 if cheap else 0
        if self.streak >= GO_INLINE:
            return self._switch("inline", f"assembling takes {self.assemble_s * 1e3:.3f} ms a "
                                f"batch, less than half a {HANDOFF_S * 1e6:.0f} µs hand-off")
        return False

    def _share(self, assemble_s: float) -> float:
        return assemble_s / max(assemble_s + self.step_s, 1e-9)

    def _switch(self, mode: str, reason: str) -> bool:
        self.mode, self.reason, self.streak = mode, reason, 0
        self.switches += 1
        return True

    def stats(self) -> dict:
        """Mode, why, switches so far, mean assemble and step milliseconds."""
        return {"mode": self.mode, "why": self.reason, "switches": self.switches,
                "assemble_ms": round(self.assemble_s * 1e3, 4),
                "step_ms": round(self.step_s * 1e3, 4)}
