"""Sequence-length schedules with the tokens of a step held constant: phase p runs from step
``start_p`` at ``seq_len_p`` with ``tokens_per_step // seq_len_p`` rows a step. Every quantity
is exact integer arithmetic of the step, so a run resumes at, before or after any phase boundary
(and on another world size: ``batch_size`` is the global batch) from the step alone::

    phases ((0, 2048), (100, 4096), (300, 8192)), tokens_per_step = 2**20
    step 99:  seq_len 2048, 512 rows, first sample  50,688, first token 103,809,024
    step 100: seq_len 4096, 256 rows, first sample  51,200, first token 104,857,600

``first_token`` is step · tokens_per_step: a concat stream cut at the step's seq_len covers
every token once across phases; ``first_sample`` counts rows (of whatever length) before it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise
from typing import NamedTuple

from tokenmill.base.errors import ConfigError, check_int, is_int

__all__ = ["LengthSchedule", "StepShape"]


class StepShape(NamedTuple):
    """What step k of a schedule reads."""

    seq_len: int
    batch_size: int  # rows of the global batch
    first_sample: int  # rows of the run before this step
    first_token: int  # tokens of the run before this step (step · tokens_per_step)
    phase: int


@dataclass(frozen=True)
class LengthSchedule:
    """Phases ``((start step, seq_len), …)`` — the first at step 0, starts rising — at a
    constant ``tokens_per_step``, a multiple of every phase's seq_len.

    LengthSchedule(((0, 4), (2, 8)), tokens_per_step=16).at(3).first_sample == 10
    """

    phases: tuple[tuple[int, int], ...]
    tokens_per_step: int

    def __post_init__(self):
        t = check_int("tokens_per_step", self.tokens_per_step, minimum=1)
        try:
            phases = tuple((p[0], p[1]) for p in self.phases)
        except (TypeError, IndexError, KeyError):
            raise ConfigError(f"seq_len_schedule must be (start step, seq_len) pairs (got "
                              f"{self.phases!r})") from None
        if not phases or not all(is_int(s) and is_int(n) for s, n in phases):
            raise ConfigError(f"seq_len_schedule must be a non-empty list of (start step, "
                              f"seq_len) int pairs (got {self.phases!r})")
        phases = tuple((int(s), int(n)) for s, n in phases)
        starts = [s for s, _ in phases]
        if starts[0] != 0 or any(b <= a for a, b in pairwise(starts)):
            raise ConfigError(f"seq_len_schedule's phase starts must begin at step 0 and rise "
                              f"(got {starts}): "
                              "list the (start step, seq_len) phases in the order they start")
        for s, n in phases:
            if n < 1 or t % n:
                raise ConfigError(f"the phase at step {s} has seq_len={n}, which does not divide "
                                  f"tokens_per_step={t}; make tokens_per_step a multiple of "
                                  "every seq_len so each step holds the same tokens")
        object.__setattr__(self, "phases", phases)
        object.__setattr__(self, "tokens_per_step", t)

    def _firsts(self) -> list[int]:
        """Rows before each phase starts (Python ints: exact at any size)."""
        out = [0]
        for (a, n), (b, _) in pairwise(self.phases):
            out.append(out[-1] + (b - a) * (self.tokens_per_step // n))
        return out

    def at(self, step: int) -> StepShape:
        """seq_len, global batch rows, rows and tokens before step ``step``, and its phase."""
        step = check_int("step", step, minimum=0)
        p = max(i for i, (s, _) in enumerate(self.phases) if s <= step)
        start, n = self.phases[p]
        rows = self.tokens_per_step // n
        return StepShape(n, rows, self._firsts()[p] + (step - start) * rows,
                         step * self.tokens_per_step, p)

    @property
    def chunk_tokens(self) -> int:
        """The least common multiple of the phases' seq_lens (the longest, for powers of two):
        every step is whole chunks of it, and every row lies inside one.

        LengthSchedule(((0, 4), (2, 8)), tokens_per_step=16).chunk_tokens == 8
        """
        return math.lcm(*(n for _, n in self.phases))

    def locate(self, sample: int) -> tuple[int, int]:
        """(step, row within that step) of the run's row number ``sample``.

        LengthSchedule(((0, 4), (2, 8)), tokens_per_step=16).locate(9) == (2, 1)
        """
        sample = check_int("sample", sample, minimum=0)
        firsts = self._firsts()
        p = max(i for i, f in enumerate(firsts) if f <= sample)
        start, n = self.phases[p]
        k, row = divmod(sample - firsts[p], self.tokens_per_step // n)
        return start + k, row

    def step_at_sample(self, samples: int) -> int:
        """The step that begins after ``samples`` rows (a checkpoint's consumed_samples);
        ConfigError when that count falls inside a step.

        LengthSchedule(((0, 4), (2, 8)), tokens_per_step=16).step_at_sample(10) == 3
        """
        step, row = self.locate(check_int("samples", samples, minimum=0))
        if row:
            s = self.at(step)
            raise ConfigError(f"{samples:,} samples falls inside step {step} (phase {s.phase}, "
                              f"{s.batch_size} rows a step): a checkpoint of this schedule is "
                              "taken between steps; was it made with other phases or "
                              "tokens_per_step?")
        return step

    def described(self) -> dict:
        """The schedule as a state records it (JSON).

        LengthSchedule(((0, 4),), tokens_per_step=16).described()["phases"] == [[0, 4]]
        """
        return {"phases": [list(p) for p in self.phases], "tokens_per_step": self.tokens_per_step}
