"""A saved loader state, checked once: its shape, its counts and its mixture phases.

Every batch stream (the store ``Loader``, ``StreamLoader``, ``MixedStreamLoader``) saves a small
JSON-able state — ``{"version": 1, "consumed_samples": k, "fingerprint": "…", …}``, a streaming
one also its ``"mode"`` — and checks one at ``load_state_dict`` by the rules here, the same for
all of them:

- ``consumed_of``: a mapping of version 1 and this loader's mode, this loader's fingerprint, and
  ``consumed_samples`` an int in [0, 2**63);
- ``count_of``: each count a state holds is "an int >= k, not a bool", numpy integers of any
  width accepted (``errors.check_int``);
- ``same_weights`` / ``phase_changes``: mixture phases compared by what they draw — the stores of
  weight > 0 and the sampler's rationalized proportions — so ``{a: 0.9, b: 0.1}`` and
  ``{a: 9, b: 1}`` are one phase; a phase that started before the checkpoint may not change.

    same_weights({"a": 0.9, "b": 0.1}, {"a": 9, "b": 1}) and not same_weights([1, 1], [1, 2])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from tokenmill.base.errors import ConfigError, check_int, is_int
from tokenmill.load import sampler
from tokenmill.load.mixture import is_weight

__all__ = ["Difference", "MAX_CONSUMED", "STATE_VERSION", "consumed_of", "count_of",
           "phase_changes", "phases_of", "respelled", "same_weights"]

STATE_VERSION = 1  # of every loader's state: {"version", "consumed_samples", "fingerprint", …}
MAX_CONSUMED = (1 << 63) - 1  # consumed_samples and every global position are int64s
STORE_DIFFERS = "the stores, seq_len, layout, seed or mixture weights differ from the run that " \
                "saved it"


class Difference(NamedTuple):
    """One way the saved stream and this loader's differ, and whether resuming stays exact."""

    what: str
    safe: bool


def count_of(name: str, value: Any, *, minimum: int = 0, maximum: int | None = None,
             optional: bool = False) -> int | None:
    """A count of a saved state as a plain int (``errors.check_int``'s rule), else a ConfigError
    that says to pass the state unchanged.

    count_of("consumed_samples", np.int64(8)) == 8
    """
    try:
        return check_int(name, value, minimum=minimum, maximum=maximum, optional=optional)
    except ConfigError as e:
        raise ConfigError(f"{e}; pass the state_dict() a loader saved, unchanged") from None


def consumed_of(state: Any, fingerprint: str, *, mode: str | None = None, kind: str = "loader",
                differs: str = STORE_DIFFERS, also: Sequence[str] = ()) -> int:
    """``consumed_samples`` of a saved state, checked once: a mapping of version 1 whose ``mode``
    is this loader's (None: a store Loader's), whose fingerprint is ``fingerprint`` (or one of
    ``also``: this stream spelled otherwise), and an int in [0, 2**63) (numpy integers are fine;
    True, 1.0 and "8" are not); else a ConfigError saying what is wrong (``differs``: what a
    fingerprint that differs means).

    consumed_of({"version": 1, "consumed_samples": 8, "fingerprint": "f"}, "f") == 8
    """
    if not isinstance(state, Mapping) or not is_int(state.get("version")) or \
            state.get("version") != STATE_VERSION or state.get("mode") != mode:
        want = f"version {STATE_VERSION}" + (f", mode {mode!r}" if mode else "")
        raise ConfigError(f"unsupported {kind} state (want {want}): {state!r}")
    if state.get("fingerprint") != fingerprint and state.get("fingerprint") not in also:
        raise ConfigError(f"loader state fingerprint {state.get('fingerprint')!r} does not match "
                          f"this loader's {fingerprint!r}: {differs}")
    return count_of("consumed_samples", state.get("consumed_samples"), maximum=MAX_CONSUMED)


# ---- mixture phases -----------------------------------------------------------------------------

def _draws(weights: Mapping | Sequence) -> tuple:
    """What a phase's weights draw: the stores of weight > 0 (names, or positions of a list) and
    the sampler's numerators for them."""
    items = weights.items() if isinstance(weights, Mapping) else enumerate(weights)
    drawn = sorted((n, w) for n, w in items if w > 0)
    if not drawn:
        return ()
    return tuple(n for n, _ in drawn), sampler.mixture_schedule([w for _, w in drawn]).numerators


def same_weights(a: Mapping | Sequence | None, b: Mapping | Sequence | None) -> bool:
    """Whether two phases' weights ({name: weight}, or one a store by position) draw the same:
    ``{a: 0.9, b: 0.1}`` is ``{a: 9, b: 1}``; a store of weight 0 is a store left out.

    same_weights([0.9, 0.1], [9, 1]) and same_weights({"a": 1, "b": 0}, {"a": 3})
    """
    if a is None or b is None:
        return a is b
    return a == b or _draws(a) == _draws(b)


def respelled(saved: Any, now: Sequence[float]) -> tuple[float, ...] | None:
    """``saved`` fixed weights (one a store) if they are ``now`` spelled otherwise — other
    numbers, the same draws — else None (the same numbers, other draws, or not weights).

    respelled([0.9, 0.1], (9.0, 1.0)) == (0.9, 0.1) and respelled([1, 1], (1.0, 2.0)) is None
    """
    if not isinstance(saved, Sequence) or isinstance(saved, str) or len(saved) != len(now) or \
            not all(is_weight(w) and w > 0 for w in saved):
        return None
    saved = tuple(float(w) for w in saved)
    return saved if saved != tuple(now) and same_weights(saved, now) else None


def phases_of(record: Any) -> list[tuple[int, dict]]:
    """A saved schedule ``[[first sample, {name: weight}], …]`` as (start, weights) pairs; a
    ConfigError naming what is malformed."""
    if not isinstance(record, Sequence) or isinstance(record, str):
        raise ConfigError(f"the state's mixture must be a list of [first sample, {{name: weight}}] "
                          f"phases (got {record!r}); pass the state_dict() a loader saved, "
                          "unchanged")
    out = []
    for i, phase in enumerate(record):
        ok = isinstance(phase, Sequence) and len(phase) == 2 and isinstance(phase[1], Mapping)
        if not ok or not all(is_weight(w) and w >= 0 for w in phase[1].values()):
            raise ConfigError(f"phase {i} of the state's mixture must be [first sample, {{name: "
                              f"weight >= 0}}] (got {phase!r}); pass the state_dict() a loader "
                              "saved, unchanged")
        out.append((count_of(f"the first sample of phase {i}", phase[0]), dict(phase[1])))
    return out


def phase_changes(saved: Any, now: Sequence, consumed: int) -> list[Difference]:
    """Every edit between a saved schedule and this loader's (``[[start, {name: weight}], …]``),
    phases compared by ``same_weights``: safe for a phase that starts at or after ``consumed``
    (the checkpoint), unsafe for one that started before it (its samples were consumed)."""
    old, new = dict(phases_of(saved)), dict(phases_of(now))
    order = {s: i for i, s in enumerate(sorted(old))} | {s: i for i, s in enumerate(sorted(new))}
    out = []
    for start in sorted(old.keys() | new.keys()):
        o, n = old.get(start), new.get(start)
        if o is not None and n is not None and same_weights(o, n):
            continue
        name = f"phase {order[start]} (from sample {start:,})"
        change = ("was added" if o is None else "was removed" if n is None
                  else f"changed {o} → {n}")
        if start < consumed:
            out.append(Difference(f"{name} {change}, but it started before the checkpoint (the "
                                  f"run has consumed {consumed:,} samples): only phases that "
                                  "start after the checkpoint may change", False))
        else:
            out.append(Difference(f"{name} {change} (starts after the checkpoint)", True))
    return out
