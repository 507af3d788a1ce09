"""Taking a Loader's batches to a device ahead of the step: the state both device wrappers share.

``integrations.torch.TorchBatches`` and ``integrations.jax.JaxBatches`` copy batches ``depth`` steps
ahead; what they hand out, not what they copied, is what a checkpoint counts.
"""

from __future__ import annotations

from typing import Any, Mapping

from tokenmill.base.errors import StaleIterator, check_int
from tokenmill.load.lifetime import Iteration, OneIterator, Pass
from tokenmill.load.loader import Loader

__all__ = ["AheadOfLoader"]


class AheadOfLoader(OneIterator):
    """Base of wrappers taking a Loader's batches ``depth`` ahead to a device (``to_torch``,
    ``to_jax``): their state counts only batches handed out (``_hand_out`` before each yield of
    a pass, ``_pass``), so resuming is exact; one live iterator, as the Loader's (an earlier one
    raises StaleIterator); ``close()`` closes the loader too."""

    def __init__(self, loader: Loader, depth: int):
        self.loader, self.depth = loader, check_int("depth", depth, minimum=1)
        self._consumed = loader.consumed_samples
        self._spans = None  # record_spans: where "device copy" spans go, or None
        self._finalizer = loader.close  # run by close()

    def __len__(self) -> int:
        """Steps per epoch, as the loader's."""
        return len(self.loader)

    def __iter__(self) -> Pass:
        """Batches from the last one handed out; an earlier iterator raises StaleIterator at its
        next ``next()``."""
        token = self._new_iteration()
        self.loader.load_state_dict(self.state_dict())  # drop what the earlier pass took ahead
        return Pass(token, self._pass(token))

    def _hand_out(self, token: Iteration, consumed: int) -> None:
        """Count a batch as handed out by the pass ``token``; StaleIterator if that pass was
        retired meanwhile (by another thread)."""
        if not self._live(token):
            raise StaleIterator(token.why or "this loader was iterated again, loaded or closed")
        self._consumed = consumed

    def record_spans(self, sink) -> None:
        """Report stages as ``sink(name, start, end)``: the loader's, and "device copy" (a
        ``Watch(trace=)`` sets it; None stops)."""
        self._spans = sink
        self.loader.record_spans(sink)

    def stage_times(self) -> dict[str, float]:
        """The loader's cumulative seconds per stage (what ``Watch`` compares across ranks)."""
        return self.loader.stage_times()

    def state_dict(self) -> dict[str, Any]:
        """The loader's state as of the last batch handed out (in-flight ones excluded)."""
        return {**self.loader.state_dict(), "consumed_samples": int(self._consumed)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (checked by the loader); an iterator from before raises
        StaleIterator at its next ``next()``."""
        self.loader.load_state_dict(state)
        self._consumed = self.loader.consumed_samples
        self._loaded(self._consumed)
