"""The contract of every batch stream, and its one live iterator.

``BatchStream`` is what the store ``Loader``, ``StreamLoader``, ``MixedStreamLoader`` and the
device wrappers (``device.AheadOfLoader``) all are: iterate from the current position, a small
JSON-able ``state_dict``, ``load_state_dict`` to continue one exactly, ``close``.

``OneIterator`` is how each of them keeps one live iterator: a new ``iter()``,
``load_state_dict`` or ``close`` retires the earlier iterator, whose next ``next()`` raises
StaleIterator — it never ends quietly, and never hands out a batch twice::

    class MyLoader(OneIterator):
        def _pass(self, token):
            return self._batches(token)   # a generator of this pass's batches
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Protocol, runtime_checkable

from tokenmill.base.errors import StaleIterator

__all__ = ["BatchStream", "Iteration", "OneIterator", "Pass"]


@runtime_checkable
class BatchStream(Protocol):
    """A stream of batches (dicts of arrays) that resumes exactly: the store ``Loader``, the
    streaming loaders, the device wrappers."""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Batches from the current position; an earlier iterator raises StaleIterator."""

    def state_dict(self) -> dict[str, Any]:
        """The position, small and JSON-able: what ``load_state_dict`` continues from."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue exactly from ``state``, or a ConfigError saying what differs."""

    def close(self) -> None:
        """Release threads, processes and files; safe to call twice."""


class Iteration:
    """One iterator's token: ``why`` is set when its loader moved on without it; ``on_retire``,
    if set, stops the work the iterator took ahead (called once, at retirement)."""

    __slots__ = ("why", "on_retire")

    def __init__(self):
        self.why: str | None = None
        self.on_retire: Callable[[], None] | None = None


class Pass:
    """An iterator over ``batches`` that raises its token's StaleIterator once retired; closing
    ``batches`` at retirement runs its ``finally`` (cancelling what it prefetched)."""

    __slots__ = ("token", "batches")

    def __init__(self, token: Iteration, batches: Iterator):
        self.token, self.batches = token, batches
        token.on_retire = self._close

    def __iter__(self) -> Pass:
        return self

    def __next__(self):
        if self.token.why is not None:
            raise StaleIterator(self.token.why)
        try:
            return next(self.batches)
        except Exception as e:  # StopIteration too: a pass closed under us never ends quietly
            if self.token.why is None:
                raise
            # retired by another thread meanwhile (close, iter, load_state_dict): what failed
            # underneath — a closed store, a cancelled future, a stopped worker — is its effect
            raise StaleIterator(self.token.why) from e

    def _close(self) -> None:
        try:
            self.batches.close()
        except ValueError:  # running in another thread: it raises at its next check
            pass


class OneIterator:
    """The lifetime of a loader: one live iterator (``_new_iteration``), retired by the next
    ``iter()``, by ``_loaded`` (``load_state_dict``) and by ``close``, which then runs
    ``self._finalizer``. Subclasses give a pass's batches (``_pass``) and keep ``_consumed``
    (named in the messages)."""

    _closed = False
    _iterating: Iteration | None = None
    _consumed = 0
    _pickle_hint = ""  # what else to do instead of pickling it, for the message

    def __iter__(self) -> Pass:
        """Batches from the current position. An earlier iterator raises StaleIterator at its
        next ``next()`` (never ends quietly) once the loader is iterated again, loaded or
        closed."""
        token = self._new_iteration()
        return Pass(token, self._pass(token))

    def _pass(self, token: Iteration) -> Iterator:
        """The batches of the pass ``token`` stands for (a generator: closed at retirement)."""
        raise NotImplementedError(f"{type(self).__name__} gives no _pass")

    def _new_iteration(self) -> Iteration:
        """The token of a new iterator, the earlier one retired."""
        if self._closed:
            raise StaleIterator("this loader is closed")
        self._retire(f"this loader was iterated again (a new iter() on it) after this iterator "
                     f"was made; its batches continue in the new iterator, from consumed_samples"
                     f"={self._consumed:,}. Keep one iterator (it = iter(loader)) to call "
                     "next(it) inside a loop, or make a second loader")
        self._iterating = token = Iteration()
        return token

    def _live(self, token: Iteration) -> bool:
        """Whether ``token`` is still the live iterator's (not retired meanwhile by another
        thread)."""
        return self._iterating is token

    def _loaded(self, consumed: int, how: str = "load_state_dict") -> None:
        """Retire the live iterator: a state was loaded (``how``); the loader now stands at
        ``consumed`` samples, where a new iterator continues."""
        self._retire(f"this loader's state was loaded ({how}) after this iterator was made; "
                     f"iterate again to continue from consumed_samples={consumed:,}")

    def _retire(self, why: str) -> None:
        token, self._iterating = self._iterating, None
        if token is not None:
            token.why = why
            if token.on_retire is not None:
                token.on_retire()

    def close(self) -> None:
        """Stop the workers and producer threads and release what the loader holds; safe to
        call twice."""
        self._closed = True
        self._retire("this loader is closed")
        self._finalizer()

    def __reduce_ex__(self, protocol):
        """Refused, saying what to do (pickle and copy used to fail on a thread lock): a loader
        owns open stores, threads and processes; its state is ``state_dict()``."""
        raise TypeError(f"a {type(self).__name__} cannot be pickled or copied (it holds open "
                        "stores, threads and worker processes): pickle its state_dict() instead "
                        "(small, JSON-able), and in the other process make the same loader and "
                        f"call load_state_dict(state){self._pickle_hint}")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
