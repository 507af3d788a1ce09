"""Sequence-length schedules in the Loader (issue 25): step k reads ``tokens_per_step`` tokens of
one concat stream, cut into rows of the step's seq_len (``seqlens.LengthSchedule``).

The stream is the store cut into chunks of C tokens — C the least common multiple of the phases'
seq_lens (the longest, for powers of two) — in the concat layout's order at seq_len C: an epoch
permutation of the chunks, and a chunk offset per epoch (the chunk plan is a ``BatchPlan`` at
seq_len C). Step k holds stream tokens [k·T, (k+1)·T): whole chunks, as T is a multiple of every
seq_len; its row j is the L inputs (and L targets, one token on) at stream token k·T + j·L,
inside one chunk. So every token of an epoch's chunks is an input exactly once whatever the
phases, and a row is a pure function of (store, seed, schedule, its global row number): resume
is exact at any step, and on any world size that shares every phase's rows::

    phases ((0, 8), (3, 16)), tokens_per_step 64: C = 16, 4 chunks a step
    step 2 (seq_len 8): rows 16 … 23 = chunks 8 … 11, two rows a chunk
    step 3 (seq_len 16): rows 24 … 27 = chunks 12 … 15, one row a chunk

The rows of a chunk are neighbours in their step (C / L of them): the order is shuffled by chunk.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Mapping

import numpy as np
import xxhash

from tokenmill.base.errors import ConfigError
from tokenmill.load.plan import BatchPlan, SampleSource, batch_arrays
from tokenmill.load.seqlens import LengthSchedule, StepShape

__all__ = ["LengthPlan", "length_plan", "one_shape", "schedule_of"]


def schedule_of(options, *, seq_len, batch_size, layout: str, source) -> LengthSchedule | None:
    """A Loader's ``seq_len_schedule`` and ``tokens_per_step`` (``options``) as one
    LengthSchedule, checked against its other settings; None when it has none."""
    phases, tokens = options.seq_len_schedule, options.tokens_per_step
    if phases is None and tokens is None:
        if seq_len is None or batch_size is None:
            raise ConfigError(f"Loader needs seq_len and batch_size (got seq_len={seq_len!r}, "
                              f"batch_size={batch_size!r}), or seq_len_schedule=[(step, seq_len),"
                              " …] with tokens_per_step=…")
        return None
    if phases is None or tokens is None:
        raise ConfigError(f"seq_len_schedule and tokens_per_step go together (got seq_len_"
                          f"schedule={phases!r}, tokens_per_step={tokens!r}): a step's rows are "
                          "tokens_per_step // its seq_len")
    if seq_len is not None or batch_size is not None:
        raise ConfigError(f"seq_len_schedule decides each step's seq_len and rows (tokens_per_"
                          f"step // seq_len): drop seq_len={seq_len!r} and batch_size="
                          f"{batch_size!r}")
    sched = LengthSchedule(phases, tokens_per_step=tokens)
    _check_settings(sched, options, layout=layout, source=source)
    return sched


def _check_settings(sched: LengthSchedule, options, *, layout: str, source) -> None:
    """Refuse what a schedule does not take: packed rows, mixtures, balance, process workers."""
    why = None
    if layout != "concat":
        why = (f"layout={layout!r}: packed rows are planned at one seq_len, and a phase change "
               "would have to repack the documents an epoch has not reached — use "
               "layout='concat' (with document_masks=True for per-document attention)")
    elif isinstance(source, Mapping) or options.mixture is not None:
        why = "a mixture of stores: the schedule cuts one store's token stream; pass one store"
    elif options.balance is not None:
        why = (f"balance={options.balance!r}: the deal is planned for steps of one seq_len; "
               "drop balance")
    elif options.worker_type == "process":
        why = "worker_type='process': use the default thread workers"
    if why is not None:
        raise ConfigError(f"seq_len_schedule={[list(p) for p in sched.phases]} does not take {why}")


def one_shape(schedule: LengthSchedule | None, what: str,
              hint: str = "iterate the Loader itself, or to_torch(loader)") -> None:
    """Refuse a Loader with a seq_len_schedule where ``what`` needs one batch shape."""
    if schedule is not None:
        raise ConfigError(f"{what} needs one batch shape, but this Loader has seq_len_schedule="
                          f"{[list(p) for p in schedule.phases]}, whose batches change shape at "
                          f"each phase: {hint}")


def length_plan(chunks: BatchPlan, schedule: LengthSchedule | None,
                world_size: int) -> LengthPlan | None:
    """The LengthPlan of a Loader's chunk plan (None: no schedule); a refusal closes ``chunks``."""
    try:
        return None if schedule is None else LengthPlan(chunks, schedule, world_size)
    except ConfigError:
        chunks.close()
        raise


class LengthPlan:
    """A store's concat stream cut at each step's seq_len: global row positions → filled rows,
    and what a rank of ``world_size`` makes of each step."""

    def __init__(self, chunks: BatchPlan, schedule: LengthSchedule, world_size: int):
        self.chunks, self.schedule, self.world_size = chunks, schedule, world_size
        self.chunk = chunks.seq_len  # C: the chunk plan is the concat layout at seq_len C
        assert self.chunk == schedule.chunk_tokens and len(chunks.sources) == 1
        T = schedule.tokens_per_step
        for start, n in schedule.phases:
            if (T // n) % world_size:
                raise ConfigError(f"the phase at step {start} (seq_len={n}) has {T // n} rows a "
                                  f"step, which world_size={world_size} ranks cannot share "
                                  f"equally; make tokens_per_step={T} a multiple of world_size × "
                                  f"{self.chunk} = {world_size * self.chunk:,} (each seq_len's "
                                  "rows, shared by the ranks)")
        self.tokens_per_epoch = chunks.samples_per_epoch * self.chunk
        self.steps_per_epoch = self.tokens_per_epoch // T
        if self.steps_per_epoch < 1:
            raise ConfigError(f"tokens_per_step={T:,} is more than one epoch holds "
                              f"({self.tokens_per_epoch:,} tokens in chunks of {self.chunk:,}); "
                              "lower tokens_per_step")
        store, config = chunks.sources[0].store, chunks.config
        self.sources = {n: SampleSource(store, replace(config, seq_len=n), salt=0)
                        for n in sorted({n for _, n in schedule.phases})}
        self.fingerprint = xxhash.xxh3_64_hexdigest(json.dumps(
            [chunks.fingerprint, "seq_len_schedule", schedule.described()]).encode())

    # ---- a rank's steps ---------------------------------------------------------------------

    def step(self, consumed: int) -> StepShape:
        """The step that starts at global row ``consumed`` (ConfigError inside a step)."""
        return self.schedule.at(self.schedule.step_at_sample(consumed))

    def shape_at(self, consumed: int) -> tuple[int, int]:
        """(rows of a rank, seq_len) of the step that starts at global row ``consumed``."""
        s = self.step(consumed)
        return s.batch_size // self.world_size, s.seq_len

    def new_buffers(self, shape: tuple[int, int]) -> dict[str, np.ndarray]:
        """Freshly allocated arrays of ``shape`` (rows, seq_len)."""
        return batch_arrays(*shape, self.chunks.dtype, self.chunks.config.document_masks)

    def total_steps(self, epochs: int) -> int:
        """Steps in ``epochs`` epochs of tokens (the last partial step not run)."""
        return epochs * self.tokens_per_epoch // self.schedule.tokens_per_step

    def remaining(self, consumed: int, epochs: int) -> int:
        """Steps left of ``epochs`` epochs after global row ``consumed``."""
        return max(0, self.total_steps(epochs) - self.schedule.step_at_sample(consumed))

    def stats(self, consumed: int) -> dict[str, Any]:
        """The last step handed out before global row ``consumed`` (else the first): its phase
        (number, of how many), seq_len, rows (global, a rank's), and the next phase's step."""
        step = max(0, self.schedule.step_at_sample(consumed) - 1)
        s, phases = self.schedule.at(step), self.schedule.phases
        return {"step": step, "phase": s.phase, "phases": len(phases), "seq_len": s.seq_len,
                "rows": s.batch_size, "rows_per_rank": s.batch_size // self.world_size,
                "tokens_per_step": self.schedule.tokens_per_step,
                "next_phase_at": phases[s.phase + 1][0] if s.phase + 1 < len(phases) else None}

    def describe(self) -> dict[str, Any]:
        """What a Loader's stream record says of the schedule (seq_len, batch_size: by phase)."""
        return {"seq_len": None, "batch_size": None,
                "seq_len_schedule": self.schedule.described()}

    # ---- rows -------------------------------------------------------------------------------

    def resolve(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(store id, first token) of the rows at global ``positions``: ascending, one step's."""
        step, _ = self.schedule.locate(int(positions[0]))
        s = self.schedule.at(step)
        assert int(positions[-1]) < s.first_sample + s.batch_size, "positions of two steps"
        rel = (np.asarray(positions, np.int64) - s.first_sample) * s.seq_len
        chunk, off = np.divmod(rel, self.chunk)
        lo = s.first_token // self.chunk + int(chunk[0])
        sid, base = self.chunks.resolve(np.arange(lo, lo + int(chunk[-1] - chunk[0]) + 1))
        at = chunk - chunk[0]
        return sid[at], base[at] + off

    def fill_resolved(self, resolved: tuple[np.ndarray, np.ndarray], out: dict) -> None:
        """Fill ``out`` (rows, seq_len) with the windows at the first tokens ``resolve`` gave."""
        _, starts = resolved
        rows, seq_len = out["inputs"].shape
        self.sources[seq_len].fill_at(starts, starts.tolist(), slice(0, rows), out)

    def fill(self, positions: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """Fill ``out`` with the rows at global ``positions`` (one step's, ascending)."""
        self.fill_resolved(self.resolve(positions), out)
