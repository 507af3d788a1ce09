"""Taking a Loader's batches to a device ahead of the step: the state both device wrappers share.

``integrations.torch.TorchBatches`` and ``integrations.jax.JaxBatches`` copy batches ``depth`` steps
ahead; what they hand out, not what they copied, is what a checkpoint counts.
"""

from __future__ import annotations

from typing import Any, Mapping

from tokenmill.base.errors import check_int
from tokenmill.load.loader import Loader

__all__ = ["AheadOfLoader"]


class AheadOfLoader:
    """Base of wrappers taking a Loader's batches ``depth`` ahead to a device (``to_torch``,
    ``to_jax``): their state counts only batches handed out (``_hand_out`` before each yield of
    the pass ``_begin`` started), so resuming is exact; ``close()`` closes the loader too."""

    def __init__(self, loader: Loader, depth: int):
        self.loader, self.depth = loader, check_int("depth", depth, minimum=1)
        self._consumed = loader.consumed_samples
        self._iterating: object | None = None
        self._spans = None  # record_spans: where "device copy" spans go, or None

    def __len__(self) -> int:
        """Steps per epoch, as the loader's."""
        return len(self.loader)

    def _begin(self) -> object:
        """Start a pass where the last batch handed out left off; its token."""
        self.loader.load_state_dict(self.state_dict())  # drop what a previous pass took ahead
        self._iterating = token = object()
        return token

    def _hand_out(self, token: object, consumed: int) -> bool:
        """Count a batch as handed out by the pass ``token``; False if that pass was stopped."""
        if self._iterating is token:
            self._consumed = consumed
        return self._iterating is token

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
        """Continue from ``state`` (checked by the loader); an iterator from before stops."""
        self.loader.load_state_dict(state)
        self._consumed = self.loader.consumed_samples
        self._iterating = None

    def close(self) -> None:
        """Close the loader; safe to call twice."""
        self._iterating = None
        self.loader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
