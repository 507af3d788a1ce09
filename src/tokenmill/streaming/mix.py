"""Mixtures of text sources in streaming mode: the store Loader's two mixture spellings, each
source tokenized on the fly by its own stream.

    Loader.from_text({"web": "data/web/*.jsonl", "code": "data/code"}, tokenizer="bytes",
                     seq_len=2048, batch_size=8, cache_dir="cache/",
                     mixture=[(0, {"web": 0.9, "code": 0.1}), (80_000, {"web": 0.6, "code": 0.4})])
    Loader.from_text({"data/web/*.jsonl": 0.7, "data/code": 0.3}, …)   # fixed weights

Global position p goes to (source, draw) by the store Loader's schedule
(``sampler.assign_phased``); each source is a ``StreamLoader`` of batch size 1 whose k-th sample
is that source's k-th draw — its own pass (shuffle buffer), then its cache store's epochs — so
every source keeps its own cursor across phases, as a store of the store Loader does, and a
phase change never repeats or skips a source's samples. Every rank reads every source and keeps
its slice [rank·B, (rank + 1)·B) of each global batch. The state holds the global position and
each source's own small stream state::

    {"version": 1, "mode": "stream-mixture", "fingerprint": "…", "consumed_samples": k,
     "mixture": [[0, {"web": 0.9, "code": 0.1}], …],
     "sources": {"web": <its StreamLoader state>, "code": …}}

Phases that start after ``consumed_samples`` may be edited before a resume; an edit of an earlier
one is refused, naming it. At a resume each source continues at its draws before
``consumed_samples`` (by the schedule); its saved state contributes the cursor hint and the
pass length, checked as a ``StreamLoader`` checks them.
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import asdict
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from tokenmill.load import sampler
from tokenmill.base.errors import ConfigError, check_int
from tokenmill.load.mixture import Mixture, described_phases, mixture_of
from tokenmill.load.plan import resolve_rank
from tokenmill.load.lifetime import Iteration, OneIterator
from tokenmill.load.ranks import CheckedFirst, agree
from tokenmill.load.resume import explain
from tokenmill.load.state import STATE_VERSION, consumed_of, phase_changes, phases_of, respelled, \
    same_weights
from tokenmill.streaming.loader import StreamLoader, open_single, what_differs
from tokenmill.streaming.plan import digest, resolve_stream_workers
from tokenmill.streaming.producer import READY_BATCHES
from tokenmill.streaming.rows import new_batch

__all__ = ["MIX_MODE", "MixedStreamLoader", "draws_before", "open_mixture", "open_stream"]

MIX_MODE = "stream-mixture"


def open_stream(inputs, *, mixture: Sequence | None = None, **kwargs: Any):
    """``Loader.from_text``: one text source (a ``StreamLoader``), or a mixture of them — named
    sources with ``mixture=`` phases, or ``{inputs: weight}`` (a ``MixedStreamLoader``)."""
    if not isinstance(inputs, Mapping):
        if mixture is not None:
            raise ConfigError("mixture= needs named text sources: Loader.from_text({'web': "
                              "'data/web', 'code': 'data/code'}, mixture=[(0, {'web': 0.9, "
                              f"'code': 0.1}})], …) (got inputs={inputs!r})")
        return open_single(inputs, **kwargs)
    return open_mixture(inputs, mixture=mixture, **kwargs)


def open_mixture(inputs: Mapping, *, mixture: Sequence | None, batch_size: int,
                 rank: int | None = None, world_size: int | None = None,
                 num_workers: int | str = "auto", **kwargs: Any) -> MixedStreamLoader:
    """A MixedStreamLoader: each source a StreamLoader of batch size 1 (the other keywords are
    ``open_single``'s); the workers are shared among the sources (at least one each)."""
    mix, items = mixture_of(inputs, mixture)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    rank, world_size = resolve_rank(check_int("rank", rank, minimum=0, optional=True),
                                    check_int("world_size", world_size, minimum=1, optional=True))
    workers = resolve_stream_workers(num_workers)
    each = max(1, workers // len(items)) if workers else 0
    sources: list[StreamLoader] = []
    try:
        for item in items:
            sources.append(open_single(item, batch_size=1, rank=0, world_size=1,
                                       num_workers=each, **kwargs))
        same = [(a, b) for i, a in enumerate(sources) for b in sources[:i]
                if a.store_path == b.store_path]
        if same:  # one cache, one writer: the slower source would wait for the other forever
            a, b = (mix.names[sources.index(x)] for x in same[0])
            raise ConfigError(f"sources {b!r} and {a!r} are the same inputs read with the same "
                              "options: make them one source (its weight the sum of theirs)")
    except BaseException:
        for s in sources:
            s.close()
        raise
    return MixedStreamLoader(mix, sources, rank=rank, world_size=world_size,
                             batch_size=batch_size)


def draws_before(phases: sampler.Phases, k: int) -> np.ndarray:
    """How many draws each source had in global positions [0, k): its cursor at k.

    draws_before(sampler.phased_schedule([(0, [1, 0]), (2, [0, 1])]), 5).tolist() == [2, 3]
    """
    i = bisect.bisect_right(phases.starts, k) - 1
    schedule, n = phases.schedules[i], k - phases.starts[i]
    cycles, rest = divmod(n, schedule.period)
    local = np.array(schedule.numerators, np.int64) * cycles + np.bincount(
        schedule.store_of[:rest], minlength=len(schedule.numerators))
    out = phases.offsets[i].copy()
    out[phases.stores[i]] += local
    return out


class MixedStreamLoader(OneIterator):
    """Batches from a mixture of text sources, each tokenized on the fly (see the module
    docstring); the batch interface of ``Loader`` and ``StreamLoader``."""

    def __init__(self, mix: Mixture, sources: list[StreamLoader], *, rank: int,
                 world_size: int, batch_size: int):
        self.mixture, self.sources = mix, sources
        self.names = mix.names
        self.schedule = sampler.phased_schedule(mix.phases)
        self.config = sources[0].config
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size
        self.epochs = self.total_steps = None  # streams run until you stop
        self.fingerprint = self._fingerprint(None if mix.named else mix.weights)
        for s in sources:  # one global batch may take all of its rows from one source
            s.ready_batches = max(READY_BATCHES, 4 * self.global_batch_size)
        self._consumed = 0
        self._states = [s.state_dict() for s in sources]  # each source's, at _consumed
        self._iters: list[Iterator | None] = [None] * len(sources)
        self._error: BaseException | None = None
        self._finalizer = weakref.finalize(self, _close_all, list(sources))

    def _fingerprint(self, weights: Sequence[float] | None) -> str:
        """Hash of the sources (names, streams) and the fixed ``weights``, which are part of the
        stream (None: named phases, compared apart: future phases may change)."""
        core = {"mixture": [[n, s.fingerprint] for n, s in zip(self.names, self.sources)]}
        if weights is not None:
            core["weights"] = list(weights)
        return digest(core)[:16]

    @property
    def global_batch_size(self) -> int:
        """Samples per step across all ranks."""
        return self.batch_size * self.world_size

    @property
    def consumed_samples(self) -> int:
        """Global samples handed out so far (all ranks)."""
        return self._consumed

    def __len__(self) -> int:
        raise TypeError("a mixture of text streams has no epoch length: its sources' passes "
                        "end at different steps")

    def _pass(self, token: Iteration) -> CheckedFirst:
        """The pass's batches, after the ranks agree."""
        return CheckedFirst(self.check_ranks, self._batches())

    def check_ranks(self) -> None:
        """Refuse, on every rank at once, settings or a position that differ from another
        rank's (``ranks.agree``); run at the first ``next()`` of each pass."""
        order = asdict(self.sources[0].plan.order_settings)
        agree("stream loader", {"mixture": described_phases(self.mixture), **order,
                                "batch_size": self.batch_size, "fingerprint": self.fingerprint,
                                "consumed_samples": self._consumed},
              rank=self.rank, world_size=self.world_size)

    def _retire(self, why: str) -> None:
        super()._retire(why)
        self._iters = [None] * len(self.sources)  # the sources' iterators of the retired one

    def _batches(self) -> Iterator[dict[str, np.ndarray]]:
        GB, B = self.global_batch_size, self.batch_size
        lo = self.rank * B
        while True:
            if self._error is not None:
                raise self._error
            k = self._consumed
            sid, draw = sampler.assign_phased(self.schedule, np.arange(k, k + GB, dtype=np.int64))
            out = new_batch(self.sources[0].plan, B)
            try:
                for j, (s, d) in enumerate(zip(sid.tolist(), draw.tolist())):
                    assert d == self.sources[s].consumed_samples, "a source's draws run in order"
                    row = next(self._source_iter(s))
                    if lo <= j < lo + B:
                        for key in out:
                            out[key][j - lo] = row[key][0]
            except BaseException as e:
                self._error = e
                raise
            self._consumed = k + GB
            for s in np.unique(sid).tolist():
                self._states[s] = self.sources[s].state_dict()
            yield out

    def _source_iter(self, s: int) -> Iterator:
        if self._iters[s] is None:
            self._iters[s] = iter(self.sources[s])
        return self._iters[s]

    # ---- what the Meter reads ---------------------------------------------------------------

    def stage_times(self) -> dict[str, float]:
        """Cumulative seconds over all sources: tokenizing, writing the caches, assembling."""
        out: dict[str, float] = {}
        for s in self.sources:
            for stage, t in s.stage_times().items():
                out[stage] = out.get(stage, 0.0) + t
        return out

    def queue_depth(self) -> int:
        """Global batches surely ready: the fewest samples ready at a source, in batches."""
        return min(s.queue_depth() for s in self.sources) // self.global_batch_size

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The global position and each source's stream state (small, JSON-able)."""
        return {"version": STATE_VERSION, "mode": MIX_MODE, "fingerprint": self.fingerprint,
                "consumed_samples": int(self._consumed),
                "mixture": described_phases(self.mixture),
                "sources": dict(zip(self.names, self._states))}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``: refuses other sources, options or layout, and an edited
        phase that started before ``consumed_samples``. Each source continues at its draws
        before that position (by the schedule), its saved ``resume_from`` only a hint: a state
        whose consumed_samples was lowered (a wrapper's, counting batches handed out) reads
        earlier, never differently."""
        k = check_mixed_state(state, self)
        before = [s.state_dict() for s in self.sources]
        try:  # a source's position is its draws before k; its saved cursor is a hint for it
            for s, name, n in zip(self.sources, self.names, draws_before(self.schedule, k)):
                s.load_state_dict({**state["sources"][name], "consumed_samples": int(n)})
        except BaseException:
            for s, old in zip(self.sources, before):
                s.load_state_dict(old)
            raise
        self._loaded(k)
        self._consumed, self._error = k, None
        self._states = [s.state_dict() for s in self.sources]

def _close_all(sources: list) -> None:
    for s in sources:
        s.close()


def check_mixed_state(state: Any, loader: MixedStreamLoader) -> int:
    """``consumed_samples`` of a mixture state, checked against ``loader`` (ConfigError): its
    fixed weights spelled otherwise continue the stream; a phase that started before the
    checkpoint may not change (``state.phase_changes``)."""
    saved = state.get("sources") if isinstance(state, Mapping) else None
    first = next(iter(saved.values()), None) if isinstance(saved, Mapping) else None
    differs = what_differs(first.get("settings") if isinstance(first, Mapping) else None,
                           loader.sources[0].plan.order_settings,
                           "the sources (names, inputs or their sizes/times), tokenizer, options "
                           "or fixed weights")
    weights, also = loader.mixture.weights, ()
    was = None if loader.mixture.named else _fixed_weights(state, loader.names)
    if was is not None and (spelled := respelled(was, weights)) is not None:
        also = (loader._fingerprint(spelled),)  # the same draws: the same stream
    elif was is not None and not same_weights(was, weights):
        differs = (f"fixed weights {dict(zip(loader.names, was))} → "
                   f"{dict(zip(loader.names, weights))} (the saved run's → this loader's); make "
                   "the loader with the saved run's weights to resume it")
    k = consumed_of(state, loader.fingerprint, mode=MIX_MODE, kind="stream mixture",
                    differs=differs, also=also)
    diffs = phase_changes(state.get("mixture"), described_phases(loader.mixture), k)
    if any(not d.safe for d in diffs):
        raise ConfigError(f"cannot resume from this state: {explain(diffs)}")
    if not isinstance(saved, Mapping) or set(saved) != set(loader.names) or \
            not all(isinstance(v, Mapping) for v in saved.values()):
        raise ConfigError(f"the state's sources must be a {{name: stream state}} dict of this "
                          f"loader's sources {sorted(loader.names)} (got {saved!r})")
    return k


def _fixed_weights(state: Any, names: tuple[str, ...]) -> tuple[float, ...] | None:
    """The fixed weights a mixture state records, one a source in ``names``' order; None when it
    records no such single phase."""
    try:
        phases = phases_of(state.get("mixture") if isinstance(state, Mapping) else None)
    except ConfigError:
        return None  # consumed_of and phase_changes say what is wrong with it
    if len(phases) != 1 or set(phases[0][1]) != set(names):
        return None
    return tuple(phases[0][1][n] for n in names)
