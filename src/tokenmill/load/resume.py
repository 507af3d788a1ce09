"""A resume that explains itself: what a saved state's stream depended on, against a loader's.

A Loader's ``state_dict()`` carries, next to ``consumed_samples`` and the fingerprint, a small
``"stream"`` record (store names and fingerprints, layout, seq_len, seed, weights or mixture
phases, batch size, world size, workers). ``differences`` compares two records and says which
changes are safe — batch size, world size, workers, mixture phases that start at or after the
checkpoint, a concat run's max_segments (a check, it changes no batch) — and which are not::

    differences({"seq_len": 2048}, {"seq_len": 4096}, 0) == [Difference("seq_len 2048 → 4096", False)]

``consumed_from`` is the Loader's ``load_state_dict`` check: a state without the record (the
three-key form) is checked by its fingerprint alone, as before.

``run_settings`` and ``same_run`` serve ``tokenmill explain``, which must explain the run that
happened: every setting that shaped its batches comes from the state's record or is given, never
assumed, and a state is only taken for the run whose stores and settings it records.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from tokenmill.base.errors import ConfigError, is_int
from tokenmill.load.state import Difference, consumed_of, phase_changes, respelled

__all__ = ["RUN_KEYS", "RUN_SETTINGS", "consumed_from", "differences", "explain", "read_state",
           "report", "run_settings", "same_run"]

UNSAFE_KEYS = ("layout", "seq_len", "seed", "max_segments", "weights")
LEGACY_PACKING = "whole-store"  # what a packed state without a "packing" record was made by
SAFE_KEYS = ("batch_size", "world_size", "num_workers")
RUN_SETTINGS = ("seq_len", "batch_size", "layout", "seed", "world_size")  # shape every batch
RUN_KEYS = (*RUN_SETTINGS, "max_segments", "weights", "mixture")  # and those that may


def _short(fingerprint: Any) -> str:
    return f"{str(fingerprint)[:12]}…"


def _stores(saved: list, now: list, named: bool) -> list[Difference]:
    saved_names, now_names = [s[0] for s in saved], [s[0] for s in now]
    if not named and [s[1] for s in saved] == [s[1] for s in now]:  # unnamed: known by path
        return [Difference(f"store paths {saved_names} → {now_names} (the same stores, moved)",
                           True)]  # a store moved to another disk reads the same
    if saved_names != now_names:
        return [Difference(f"stores {saved_names} → {now_names}", False)]
    return [Difference(f"store {a[0]!r} was re-prepared: fingerprint {_short(a[1])} → "
                       f"{_short(b[1])}", False)
            for a, b in zip(saved, now) if a[1] != b[1]]


def differences(saved: Mapping[str, Any], now: Mapping[str, Any],
                consumed: int) -> list[Difference]:
    """Every difference between a saved stream record and a loader's, unsafe ones first."""
    out = []
    if "stores" in saved and saved.get("stores") != now.get("stores"):
        named = saved.get("mixture") is not None or now.get("mixture") is not None
        out += _stores(list(saved["stores"]), list(now.get("stores") or []), named)
    sched = saved.get("seq_len_schedule"), now.get("seq_len_schedule")
    for key in UNSAFE_KEYS + SAFE_KEYS:
        if sched != (None, None) and key in ("seq_len", "batch_size"):
            continue  # a schedule's are per phase: the schedule is compared below
        if key in saved and saved.get(key) != now.get(key) and not (  # weights respelled: same
                key == "weights" and now.get(key) and respelled(saved[key], now[key]) is not None):
            out.append(Difference(f"{key} {saved.get(key)} → {now.get(key)}", key in SAFE_KEYS or
                                  key == "max_segments" and now.get("layout") == "concat"))
    masks = saved.get("document_masks", False), now.get("document_masks", False)
    if masks[0] != masks[1]:  # recorded only when on
        out.append(Difference(f"document_masks {masks[0]} → {masks[1]}", False))
    bal = saved.get("balance"), now.get("balance")
    if bal[0] != bal[1]:  # recorded only when on: which rows each rank takes
        out.append(Difference(f"balance {bal[0] or 'off'} → {bal[1] or 'off'} (cost model [a, b] "
                              "of the ranks' deal; resume with the run's balance setting)", False))
    micro = saved.get("microbatches", 1), now.get("microbatches", 1)
    if micro[0] != micro[1]:  # recorded only when > 1: the order of each rank's rows
        out.append(Difference(f"microbatches {micro[0]} → {micro[1]} (the order of a rank's "
                              "rows; resume with the run's microbatches)", False))
    strata = saved.get("stratify"), now.get("stratify")
    if strata[0] != strata[1]:  # recorded only when on: which rows make up each global batch
        out.append(Difference(f"stratify {strata[0] or 'off'} → {strata[1] or 'off'} (the rows of "
                              "each global batch; resume with the run's stratify)", False))
    if sched[0] != sched[1]:  # recorded only when on: every step's seq_len and rows
        out.append(Difference(f"seq_len_schedule {_schedule(saved)} → {_schedule(now)} "
                              "(resume with the run's seq_len_schedule and tokens_per_step)",
                              False))
    if saved.get("layout") == now.get("layout") == "packed" and \
            saved.get("packing", LEGACY_PACKING) != now.get("packing"):
        out.append(Difference(_packing_change(saved.get("packing", LEGACY_PACKING),
                                              now.get("packing")), False))
    was, new = saved.get("mixture"), now.get("mixture")
    if "mixture" in saved and (was is None) != (new is None):
        out.append(Difference(f"mixture schedule {was} → {new}", False))
    elif was is not None and was != new:
        out += phase_changes(was, new, consumed)
    return sorted(out, key=lambda d: d.safe)


def _schedule(stream: Mapping[str, Any]) -> str:
    """A stream record's seq_len_schedule in words ("off (seq_len 2048)" when it has none)."""
    s = stream.get("seq_len_schedule")
    if not isinstance(s, Mapping):
        return f"off (seq_len {stream.get('seq_len')})"
    return f"{s.get('phases')} at {s.get('tokens_per_step')} tokens a step"


def _packing_change(was: str, now: str) -> str:
    if was != LEGACY_PACKING:
        how = ("a store of short documents (16 or more a row) packs each window's documents in "
               "order, taken in runs of a row's worth of consecutive documents"
               if "ordered" in f"{was} {now}" else "packed rows are allotted to windows "
               "differently")
        return (f"packing {was} → {now}: the state was saved by a tokenmill that packed rows "
                f"otherwise ({now}: {how}), so the same step holds other rows — finish that "
                "run with the tokenmill version that saved it, or start the data stream of a new "
                "run here (a fresh Loader, no load_state_dict)")
    return ("packing: the state was saved by an earlier tokenmill whose packed layout was one "
            "index over the whole store, built by every rank; this version packs documents "
            f"window by window ({now}), so the same step holds other rows — finish that run with "
            "the tokenmill version that saved it, or start the data stream of a new run here "
            "(a fresh Loader, no load_state_dict)")


def explain(diffs: list[Difference]) -> str:
    """The differences as one message: what makes the resume inexact, then what is safe."""
    unsafe = [d.what for d in diffs if not d.safe]
    safe = [d.what for d in diffs if d.safe]
    parts = []
    if unsafe:
        parts.append("this loader's stream differs from the saved run's: " + "; ".join(unsafe))
    if safe:
        parts.append("safe to change: " + "; ".join(safe))
    return ". ".join(parts) if parts else "the loader matches the saved state"


def report(state: Mapping[str, Any], stream: Mapping[str, Any],
           fingerprint: str) -> list[Difference]:
    """How a saved ``state`` and a loader (``stream``, ``fingerprint``) differ, unsafe first; a
    state without a ``stream`` record (the three-key form) by its fingerprint alone."""
    saved = state.get("stream") if isinstance(state, Mapping) else None
    if not isinstance(saved, Mapping):
        was = state.get("fingerprint") if isinstance(state, Mapping) else None
        if was == fingerprint:
            return []
        return [Difference(f"fingerprint {was} → {fingerprint} (the state records no more: the "
                           "stores, seq_len, layout, seed or weights differ)", False)]
    at = state.get("consumed_samples")  # consumed_of says what is wrong with one that is not
    return differences(saved, stream, int(at) if is_int(at) and at > 0 else 0)


def read_state(path: str | os.PathLike) -> dict:
    """A loader state saved as JSON (``json.dump(loader.state_dict(), f)``); a one-line
    ConfigError when the file is not that (a torch.save or pickle file, other JSON)."""
    data = Path(path).read_bytes()
    try:
        state = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        # torch.save writes a zip ("PK"), pickle starts with its protocol byte 0x80
        kind = " (a torch.save or pickle file?)" if data[:2] == b"PK" or data[:1] == b"\x80" \
            else f" ({e})"
        raise ConfigError(f"{path}: not a JSON loader state{kind}; save the state as JSON, "
                          "json.dump(loader.state_dict(), open('state.json', 'w')), or convert "
                          "a .pt: json.dump(torch.load('state.pt'), open('state.json', 'w'))") from None
    if not isinstance(state, dict):
        raise ConfigError(f"{path}: holds a JSON {type(state).__name__}, not a loader state (a "
                          "JSON object: json.dump(loader.state_dict(), f))")
    return state


def consumed_from(state: Mapping[str, Any], stream: Mapping[str, Any], fingerprint: str, *,
                  also: Sequence[str] = ()) -> int:
    """``consumed_samples`` of ``state`` if this loader (``stream``, ``fingerprint``; ``also``:
    its fingerprint under the state's spelling of its weights) continues it exactly; else
    ConfigError saying what differs and what would have been safe."""
    saved = state.get("stream") if isinstance(state, Mapping) else None
    if isinstance(saved, Mapping):
        diffs = report(state, stream, fingerprint)
        if any(not d.safe for d in diffs):
            was = state.get("fingerprint")
            why = "" if was == fingerprint else \
                f" (loader state fingerprint {was!r}, this loader's {fingerprint!r})"
            raise ConfigError(f"cannot resume from this state: {explain(diffs)}{why}")
    return consumed_of(state, fingerprint, also=also)


def run_settings(state: Mapping[str, Any], given: Mapping[str, Any], *, stores: int,
                 named: bool, where: str | None = None) -> dict[str, Any]:
    """The Loader settings of a run over ``stores`` stores (``named``: NAME=STORE): each in
    ``given`` (the command line's flags), else the stream record of ``state`` (a Loader's state,
    read from ``where``; {}: none). Needed: RUN_SETTINGS; max_segments for a packed layout (None:
    no cap); the phases (``mixture``) of named stores; the ``weights`` of several unnamed ones —
    none is ever assumed: a ConfigError names every flag missing.

    run_settings({"stream": {"seed": 3}}, {"seq_len": 8, "batch_size": 4, "layout": "concat",
                                           "world_size": 1}, stores=1, named=False)["seed"] == 3
    """
    if state.get("mode") is not None:
        raise ConfigError(f"{where}: a streaming loader's state (mode {state['mode']!r}); "
                          "explain explains a Loader over stores: pass a Loader's state")
    if (named and "weights" in given) or (not named and "mixture" in given):
        raise ConfigError("fixed weights are for unnamed stores (STORE …), mixture phases for "
                          "named ones (NAME=STORE …)")
    saved = state.get("stream") if isinstance(state.get("stream"), Mapping) else {}
    known = {**{k: v for k, v in saved.items() if v is not None or k == "max_segments"}, **given}
    needed = [*RUN_SETTINGS, *(["max_segments"] if known.get("layout") == "packed" else []),
              *(["mixture"] if named else ["weights"] if stores > 1 else [])]
    settings = {k: known[k] for k in [*needed, *given] if k in known}
    if len(settings.get("weights", [None] * stores)) != stores:
        raise ConfigError(f"{len(settings['weights'])} weights for {stores} stores: give one "
                          "weight a store, in the order of the stores")
    if missing := ", ".join(f"--{k.replace('_', '-')}" for k in needed if k not in known):
        raise ConfigError(f"{where} does not record {missing}: pass them as the run had them"
                          if where else f"missing {missing}: pass each setting that shaped the "
                          "run's batches (none is assumed), or --state STATE.json (the run's "
                          "Loader.state_dict() saved as JSON)")
    return settings


def same_run(state: Mapping[str, Any], stream: Mapping[str, Any], fingerprint: str,
             where: str) -> None:
    """Raise ConfigError unless a loader (``stream``, ``fingerprint``) reads the run that saved
    ``state`` (read from ``where``): its stores and every setting a run cannot change (batch
    size and world size may differ: a run resumed elastically)."""
    unsafe = [d for d in report(state, stream, fingerprint) if not d.safe]
    if unsafe:
        raise ConfigError(f"{where}: saved by another run than these stores and settings: "
                          f"{explain(unsafe)}")
