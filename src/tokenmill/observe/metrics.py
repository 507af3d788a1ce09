"""Meter: is the training loop waiting for data? Data wait %, tokens/s, wait p50/p99, verdict, MFU.

Wrap any iterator of batches — a tokenmill Loader, a torch DataLoader, a generator, a list::

    meter = Meter(loader, report_every=100)
    for batch in meter:
        train_step(batch)
    meter.summary()["verdict"]            # e.g. "compute-bound (excellent)"

The time spent inside the wrapped ``next()`` is *waiting*; the time from the end of one ``next()``
to the start of the following one is the consumer's *step*. On a timeline::

    |- next() #1 -|-- step 1 --|- wait -|-- step 2 --|- wait -|-- step 3 --|- StopIteration
     first batch  |<------------- wall = waits + steps ------------------->|
    (not counted)

The first ``next()`` (workers starting, caches warming) is reported apart as
``time_to_first_batch_s`` and left out of the wait percentage. ``data_wait_pct`` =
100 · waits / wall. A step still in progress when ``summary()`` is called is not counted yet, and
neither is the time spent inside ``log()`` for the periodic report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from tokenmill.base.errors import ConfigError, check_int

# The verdict bands, on data wait % (seeds: "<1% excellent, >20% poor"). A boundary value never
# earns the better label and never the worse: 1.0% is not excellent, 5.0% is not data-bound,
# 20.0% is not poor. So: [0, 1) excellent | [1, 5] compute-bound | (5, 20] mild | (20, 100] poor.
EXCELLENT_BELOW_PCT = 1.0
DATA_BOUND_ABOVE_PCT = 5.0
POOR_ABOVE_PCT = 20.0

# A median step under 10 µs is a loop that does no work (a `pass` body takes ~1 µs; a model's
# step, even a tiny one on CPU, takes 100s of µs): a wait % of it says nothing about overlap.
NO_STEP_S = 10e-6
DEFAULT_WINDOW = 10_000  # waits kept for p50/p99: 80 kB, a few minutes of fast steps


def verdict_for(data_wait_pct: float) -> str:
    """The bottleneck verdict for a data wait percentage (bands above, boundaries included).

    [verdict_for(p) for p in (0.5, 1.0, 5.0, 5.1, 20.0, 20.1)] == ["compute-bound (excellent)",
    "compute-bound", "compute-bound", "data-bound (mild)", "data-bound (mild)", "data-bound (poor)"]
    """
    if data_wait_pct < EXCELLENT_BELOW_PCT:
        return "compute-bound (excellent)"
    if data_wait_pct <= DATA_BOUND_ABOVE_PCT:
        return "compute-bound"
    if data_wait_pct <= POOR_ABOVE_PCT:
        return "data-bound (mild)"
    return "data-bound (poor)"


def count_tokens(batch: Any) -> int:
    """Tokens in a batch: a dict's ``inputs`` (else its first array), a tuple's first element.

    count_tokens({"inputs": np.zeros((8, 2048)), "targets": ...}) == 16384
    """
    if isinstance(batch, Mapping):
        if "inputs" in batch:
            return count_tokens(batch["inputs"])
        for value in batch.values():
            if _is_array(value):
                return count_tokens(value)
        raise TypeError(f"cannot count tokens in a dict with keys {list(batch)[:8]}: no 'inputs' "
                        "and no array value; pass Meter(..., tokens_per_batch=N)")
    if isinstance(batch, (tuple, list)) and batch and not isinstance(batch[0], (int, float)):
        return count_tokens(batch[0])  # (inputs, targets, ...)
    numel = getattr(batch, "numel", None)
    if callable(numel):  # torch: .size is a method, numel() the count
        return int(numel())
    size = getattr(batch, "size", None)
    if isinstance(size, (int, np.integer)):  # numpy, jax: never np.asarray a device array
        return int(size)
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return int(np.prod(tuple(shape), dtype=np.int64))
    return int(np.size(batch))


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") or callable(getattr(x, "numel", None))


@dataclass(frozen=True)
class ModelCost:
    """What turns tokens/s into FLOP/s and MFU: training FLOPs per token, and the device's peak.

    ``peak_flops`` is the peak FLOP/s of the devices this Meter's batches feed (one GPU per rank:
    that GPU's dense bf16 peak, e.g. 989e12 for an H100 SXM). Without it MFU is unknown.
    ModelCost(flops_per_token=6e9, peak_flops=1e15).flops_per_token == 6e9
    """

    flops_per_token: float
    peak_flops: float | None = None

    def __post_init__(self):
        if not _positive(self.flops_per_token):
            raise ConfigError(f"flops_per_token must be a number > 0 "
                              f"(got flops_per_token={self.flops_per_token!r})")
        if self.peak_flops is not None and not _positive(self.peak_flops):
            raise ConfigError(f"peak_flops must be None or a number > 0 "
                              f"(got peak_flops={self.peak_flops!r})")

    @classmethod
    def from_params(cls, n_params: int, *, seq_len: int, n_layers: int, d_model: int,
                    peak_flops: float | None = None) -> ModelCost:
        """Training FLOPs per token of a decoder-only transformer: 6·N + 12·n_layers·d_model·T.

        T is seq_len. 6·N is forward (2·N) plus backward (4·N) through the weights; 12·L·d·T
        is the attention scores and weighted sum (QKᵀ and AV) over T tokens, forward and backward,
        without causal-mask savings. Source: Chowdhery et al. 2022, "PaLM", Appendix B (MFU),
        also used by nanoGPT's ``estimate_mfu``; Hoffmann et al. 2022, "Chinchilla", Appendix F,
        counts the same terms in more detail. Pass the non-embedding parameter count for N.

        ModelCost.from_params(124_000_000, seq_len=1024, n_layers=12, d_model=768).flops_per_token
        == 6 * 124_000_000 + 12 * 12 * 768 * 1024 == 857_246_208
        """
        n_params, seq_len, n_layers, d_model = (check_int(name, v, minimum=1) for name, v in (
            ("n_params", n_params), ("seq_len", seq_len), ("n_layers", n_layers),
            ("d_model", d_model)))
        flops = 6 * n_params + 12 * n_layers * d_model * seq_len
        return cls(flops_per_token=flops, peak_flops=peak_flops)


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and bool(np.isfinite(x)) and x > 0


@runtime_checkable
class Instrumented(Protocol):
    """An iterable that says where its time goes, so a stall is pinned on a stage.

    The Meter uses either method if the wrapped iterable has it (a plain attribute also works).
    """

    def stage_times(self) -> Mapping[str, float]:
        """Cumulative seconds per stage so far, summed over workers: {"read": 1.5, …}."""

    def queue_depth(self) -> int:
        """Batches ready and waiting for the consumer right now."""


class _Ring:
    """The last ``size`` floats in a preallocated array; adding one allocates nothing."""

    __slots__ = ("values", "size", "count")

    def __init__(self, size: int):
        self.values = np.zeros(size, dtype=np.float64)
        self.size = size
        self.count = 0

    def add(self, x: float) -> None:
        self.values[self.count % self.size] = x
        self.count += 1

    def percentiles(self, qs: tuple[float, ...]) -> list[float]:
        """numpy's default (linear interpolation) percentiles; zeros while empty."""
        n = min(self.count, self.size)
        if n == 0:
            return [0.0] * len(qs)
        return [float(v) for v in np.percentile(self.values[:n], qs)]


class Meter:
    """Times an iterator of batches and the loop around it; ``summary()`` says who waits on whom.

    ``for batch in Meter(loader): ...`` — the Meter is its own iterator. ``tokens_per_batch``
    defaults to counting each batch (``count_tokens``); ``cost`` adds FLOP/s and MFU;
    ``report_every=N`` calls ``log(meter.report())`` each time step N, 2N, … ends.
    """

    def __init__(self, iterable: Iterable, *, tokens_per_batch: int | None = None,
                 cost: ModelCost | None = None, report_every: int | None = None,
                 log: Callable[[str], Any] = print, window: int = DEFAULT_WINDOW,
                 clock: Callable[[], float] = time.perf_counter):
        tokens_per_batch = check_int("tokens_per_batch", tokens_per_batch, minimum=0,
                                     optional=True)
        if cost is not None and not isinstance(cost, ModelCost):
            raise ConfigError(f"cost must be a ModelCost (got {type(cost).__name__}); "
                              "e.g. ModelCost.from_params(n, seq_len=…, n_layers=…, "
                              "d_model=…)")
        report_every = check_int("report_every", report_every, minimum=1, optional=True)
        window = check_int("window", window, minimum=1)
        self.source = iterable
        self._it = iter(iterable)
        self._tokens_per_batch = tokens_per_batch
        self.cost = cost
        self._report_every = report_every
        self._log = log
        self._window = window
        self._clock = clock
        self._stage_fn = _probe(iterable, self._it, "stage_times")
        self._depth_fn = _probe(iterable, self._it, "queue_depth")
        self._mode_fn = _probe(iterable, self._it, "stats")  # a Loader: where batches are built
        self.time_to_first_batch: float | None = None
        self._last_end: float | None = None  # end of the last next(): a step is running
        self._pending_tokens = 0  # tokens of the batch in the consumer's hands
        self.reset()

    def reset(self) -> None:
        """Forget what was measured; measure from now on (e.g. after warm-up).

        The step in progress counts from now; ``time_to_first_batch`` is kept.
        """
        self.steps = 0  # batches handed out since the reset
        self._done_steps = 0  # steps that ended (the one in progress excluded)
        self._tokens = 0
        self._done_tokens = 0  # tokens of the batches whose step ended
        self._wait_s = 0.0
        self._step_s = 0.0
        self._waits = _Ring(self._window)
        self._step_times = _Ring(self._window)
        self._depth_sum = 0.0
        self._depth_n = 0
        self._stage_base = self._stage_times() if self.time_to_first_batch is not None else None
        if self._last_end is not None:
            self._last_end = self._clock()

    # ---- the loop ---------------------------------------------------------------------------

    def __iter__(self) -> Meter:
        return self

    def __next__(self):
        t0 = self._clock()
        if self._last_end is not None:  # the consumer's step ends here
            step = t0 - self._last_end
            self._last_end = None
            self._step_s += step
            self._step_times.add(step)
            self._done_steps += 1
            self._done_tokens += self._pending_tokens
            if self._report_every and self.steps and self.steps % self._report_every == 0:
                self._log(self.report())
                t0 = self._clock()  # the report's own time is nobody's wait
        first = self.time_to_first_batch is None
        if not first and self._depth_fn is not None:
            self._depth_sum += float(self._depth_fn())
            self._depth_n += 1
        batch = next(self._it)  # StopIteration passes through, the step above already closed
        t1 = self._clock()
        if first:
            self.time_to_first_batch = t1 - t0
            self._stage_base = self._stage_times()
        else:
            self._wait_s += t1 - t0
            self._waits.add(t1 - t0)
        n = self._tokens_per_batch
        self._pending_tokens = count_tokens(batch) if n is None else n
        self._tokens += self._pending_tokens
        self.steps += 1
        self._last_end = t1
        return batch

    def _stage_times(self) -> dict[str, float] | None:
        if self._stage_fn is None:
            return None
        return {k: float(v) for k, v in self._stage_fn().items()}

    # ---- what it says -----------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """The numbers, as a flat dict for any logger (None where unknown)."""
        wall = self._wait_s + self._step_s
        pct = 100.0 * self._wait_s / wall if wall > 0 else 0.0
        tokens_per_s = self._done_tokens / wall if wall > 0 else 0.0
        p50, p99 = self._waits.percentiles((50, 99))
        (step_p50,) = self._step_times.percentiles((50,))
        stages = self._stage_delta()
        depth = self._depth_sum / self._depth_n if self._depth_n else None
        flops = mfu = None
        if self.cost is not None:
            flops = self.cost.flops_per_token * tokens_per_s
            mfu = flops / self.cost.peak_flops if self.cost.peak_flops else None
        verdict = verdict_for(pct) if wall > 0 else "warming up"
        if wall > 0 and self._done_steps and step_p50 < NO_STEP_S:
            verdict = (f"no step to compare with (median step {step_p50 * 1e6:.1f} µs): the data "
                       "wait of a loop that does no work; meter the training step")
        elif verdict.startswith("data-bound") and stages and sum(stages.values()) > 0:
            verdict += ": " + max(stages, key=stages.__getitem__)
        detail = (f"waited {_secs(self._wait_s)} of {_secs(wall)} wall ({pct:.2f}%); median wait "
                  f"{_secs(p50)} vs median step {_secs(step_p50)}")
        if stages:
            detail += "; stages " + ", ".join(f"{k} {_secs(v)}" for k, v in stages.items())
        if depth is not None:
            detail += f"; mean queue depth {depth:.1f}"
        mode = self._mode_fn() if self._mode_fn is not None else None
        if isinstance(mode, Mapping) and "mode" in mode:
            detail += f"; batches assembled {mode['mode']} ({mode.get('why', '')})"
        if self.time_to_first_batch is not None:
            detail += f"; first batch after {_secs(self.time_to_first_batch)} (not counted)"
        return {
            "steps": self.steps,
            "tokens": self._tokens,
            "wall_s": wall,
            "wait_s": self._wait_s,
            "data_wait_pct": pct,
            "tokens_per_s": tokens_per_s,
            "steps_per_s": self._done_steps / wall if wall > 0 else 0.0,
            "wait_p50_ms": p50 * 1000,
            "wait_p99_ms": p99 * 1000,
            "step_p50_ms": step_p50 * 1000,
            "time_to_first_batch_s": self.time_to_first_batch,
            "queue_depth": depth,
            "stage_s": stages,
            "flops_per_s": flops,
            "mfu": mfu,
            "verdict": verdict,
            "verdict_detail": detail,
            "loader": dict(mode) if isinstance(mode, Mapping) else None,
        }

    def _stage_delta(self) -> dict[str, float] | None:
        now = self._stage_times()
        if now is None or self._stage_base is None:
            return None
        return {k: v - self._stage_base.get(k, 0.0) for k, v in now.items()}

    def report(self) -> str:
        """The one-line report, e.g.
        ``step 1200 | 48,300 tok/s | data wait 2.1% | p99 wait 1.2 ms | compute-bound``.

        With a ModelCost that knows the peak, ``| MFU 41.3%`` comes before the verdict; with a
        balanced Loader, ``| balance 1.004 (unbalanced 1.310)``: the last step's max / mean
        cost across ranks, and with ``microbatches=m`` across every (rank, microbatch),
        ``, microbatches 1.292 (in order 1.385)``; with a seq_len_schedule,
        ``| seq_len 4,096 (phase 2 of 3)``.
        """
        s = self.summary()
        line = (f"step {s['steps']} | {s['tokens_per_s']:,.0f} tok/s | data wait "
                f"{s['data_wait_pct']:.1f}% | p99 wait {s['wait_p99_ms']:,.1f} ms")
        if s["mfu"] is not None:
            line += f" | MFU {100 * s['mfu']:.1f}%"
        if (b := (s["loader"] or {}).get("balance")) is not None:  # Loader(balance=…)
            line += f" | balance {b['max_mean']:.3f} (unbalanced {b['unbalanced_max_mean']:.3f})"
            if "microbatch_max_mean" in b:  # microbatches=m: across every (rank, microbatch)
                line += (f", microbatches {b['microbatch_max_mean']:.3f} (in order "
                         f"{b['microbatch_max_mean_in_order']:.3f})")
        if (p := (s["loader"] or {}).get("seq_len_phase")) is not None:  # seq_len_schedule=…
            line += f" | seq_len {p['seq_len']:,} (phase {p['phase'] + 1} of {p['phases']})"
        return f"{line} | {s['verdict']}"


def _probe(iterable: Any, iterator: Any, name: str) -> Callable[[], Any] | None:
    """The iterable's (else its iterator's) ``name`` as a zero-argument callable, if it has one."""
    for obj in (iterable, iterator):
        attr = getattr(obj, name, None)
        if attr is not None:
            return attr if callable(attr) else (lambda obj=obj: getattr(obj, name))
    return None


def _secs(x: float) -> str:
    return f"{x:,.1f} s" if x >= 1 else f"{x * 1000:.1f} ms"
