"""Mixtures of stores: the two spellings, checked at the door, as one ``Mixture`` value.

``{store: weight, …}`` mixes unnamed stores with fixed weights (as it always did); named stores
``{"web": "stores/web", "code": "stores/code"}`` with ``mixture=[(0, {"web": 0.9, "code": 0.1}),
(80_000, {"web": 0.6, "code": 0.4})]`` change weights at given global samples::

    mix, stores = mixture_of({"a": "s/a", "b": "s/b"}, [(0, {"a": 1}), (10, {"b": 1})])
    mix.phases == ((0, (1.0, 0.0)), (10, (0.0, 1.0))) and stores == ["s/a", "s/b"]

The sampler turns the phases into positions (``sampler.phased_schedule``); this module only
validates, names and describes them (``described_phases`` is what a checkpoint records).
"""

from __future__ import annotations

import ast
import json
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokenmill.base.errors import ConfigError, is_int, redact

__all__ = ["Mixture", "described_phases", "is_weight", "mixture_of", "phases_from_text",
           "weights_from_text"]


@dataclass(frozen=True)
class Mixture:
    """Store names and the phases: (first global sample, weight per store, 0 = not drawn)."""

    names: tuple[str, ...]
    phases: tuple[tuple[int, tuple[float, ...]], ...]
    named: bool  # stores were given names and a ``mixture=`` schedule

    @property
    def weights(self) -> tuple[float, ...]:
        """The first phase's weights (the only phase of a ``{store: weight}`` mixture)."""
        return self.phases[0][1]


def is_weight(w) -> bool:
    """A finite real number: int, float or a numpy one (not a bool).

    is_weight(0.5) and is_weight(np.int8(3)) and not is_weight(True) and not is_weight(math.inf)
    """
    return isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w)


def _name_of(store) -> str:
    return redact(str(getattr(store, "path", store)))


def mixture_of(source, mixture: Sequence | None = None) -> tuple[Mixture, list]:
    """The Mixture and the stores (in order) of a Loader's ``source`` and ``mixture=``."""
    if mixture is None:
        items = list(source.items()) if isinstance(source, Mapping) else [(source, 1.0)]
        if not items:
            raise ConfigError("a mixture needs at least one store (got an empty mapping)")
        for s, w in items:
            if isinstance(w, (str, bytes)) or hasattr(w, "__fspath__") or hasattr(w, "manifest"):
                raise ConfigError(f"{{name: store}} needs mixture=[(0, {{{s!r}: 1.0, …}}), …] "
                                  f"(got {s!r}: {_name_of(w)!r} without mixture=); a "
                                  "{store: weight} mixture maps stores to numbers")
            if not is_weight(w) or w <= 0:
                raise ConfigError(f"mixture weights must be finite and > 0 (got {w!r} for {s})")
        names = tuple(_name_of(s) for s, _ in items)
        return Mixture(names, ((0, tuple(float(w) for _, w in items)),), False), \
            [s for s, _ in items]
    if not isinstance(source, Mapping) or not source or \
            not all(isinstance(k, str) for k in source):
        raise ConfigError("mixture= needs named stores: Loader({'web': 'stores/web', 'code': "
                          f"'stores/code'}}, mixture=[(0, {{'web': 0.9, 'code': 0.1}})]) (got "
                          f"{_name_of(source) if not isinstance(source, Mapping) else source!r})")
    names = tuple(source)
    for name, store in source.items():
        if isinstance(store, (int, float)):
            raise ConfigError(f"with mixture=, the dict maps names to stores (got {name!r}: "
                              f"{store!r}); weights go in the phases")
    return Mixture(names, _phases(names, mixture), True), list(source.values())


def _phases(names: tuple[str, ...], mixture) -> tuple[tuple[int, tuple[float, ...]], ...]:
    if isinstance(mixture, (str, bytes, Mapping)) or not isinstance(mixture, Sequence) or \
            not mixture:
        raise ConfigError("mixture must be a list of (first sample, {store: weight}) phases "
                          f"(got {mixture!r})")
    phases = []
    for i, phase in enumerate(mixture):
        try:
            start, weights = phase
        except (TypeError, ValueError):
            start = None
        if not is_int(start):  # numpy integers too; True, 1.0 and "0" are not
            raise ConfigError(f"phase {i} must be (first sample: an int, {{store: weight}}) "
                              f"(got {phase!r})")
        start = int(start)
        if not isinstance(weights, Mapping):
            raise ConfigError(f"phase {i} (from sample {start:,}): weights must be a "
                              f"{{store: weight}} dict (got {weights!r})")
        for name, w in weights.items():
            if name not in names:
                raise ConfigError(f"phase {i} (from sample {start:,}) names store {name!r}; "
                                  f"the stores are {list(names)}")
            if not is_weight(w) or w < 0:
                raise ConfigError(f"phase {i} (from sample {start:,}): weight of {name!r} must "
                                  f"be finite and >= 0 (got {w!r})")
        if not any(weights.values()):
            raise ConfigError(f"phase {i} (from sample {start:,}) draws from no store "
                              f"(got {dict(weights)!r})")
        phases.append((start, tuple(float(weights.get(n, 0.0)) for n in names)))
    starts = [s for s, _ in phases]
    if starts[0] != 0 or any(a >= b for a, b in zip(starts, starts[1:])):
        raise ConfigError(f"mixture phases must be sorted by first sample, the first at 0, no "
                          f"two at the same sample (got starts {starts})")
    return tuple(phases)


def phases_from_text(text: str) -> list:
    """Phases written on a command line: JSON, or the same as a Python literal (single quotes,
    tuples); else a one-line ConfigError.

    phases_from_text("[(0, {'web': 1})]") == [(0, {"web": 1})]
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise ConfigError(f"--mixture {text!r} is neither JSON nor a Python literal; write the "
                          "phases as [[0, {\"web\": 0.9, \"code\": 0.1}], [80000, {…}]]") from None


def weights_from_text(text: str) -> list[float]:
    """Fixed weights of unnamed stores written on a command line, one a store, in their order
    (a JSON list too); else a one-line ConfigError.

    weights_from_text("0.7,0.3") == [0.7, 0.3] == weights_from_text("[0.7, 0.3]")
    """
    try:
        return [float(w) for w in text.strip().removeprefix("[").removesuffix("]").split(",")]
    except ValueError:
        raise ConfigError(f"--weights {text!r} is not a list of numbers; write one weight a "
                          "store, in the order of the stores: --weights 0.7,0.3") from None


def described_phases(mix: Mixture) -> list[list]:
    """The phases as JSON: ``[[start, {name: weight}], …]``, stores of weight 0 left out."""
    return [[start, {n: w for n, w in zip(mix.names, weights) if w > 0}]
            for start, weights in mix.phases]
