"""JAX: each process's batch becomes its part of one global ``jax.Array``, ``depth`` steps ahead.

    mesh = jax.sharding.Mesh(jax.devices(), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    loader = Loader("store/", seq_len=2048, batch_size=8,
                    rank=jax.process_index(), world_size=jax.process_count())
    for batch in to_jax(loader, sharding):    # batch["inputs"]: (8 × processes, 2048), sharded
        ...

Process r's ``(batch_size, seq_len)`` arrays are the rows ``[r·B, (r+1)·B)`` of the global batch
(the Loader's rank slice of one global batch), placed on this process's devices by
``jax.make_array_from_process_local_data``. Transfers are asynchronous: the next ``depth`` batches
are dispatched before one is handed out, so they cross to the devices while the step runs. JAX
holds a reference to each host array until its transfer is done, and the Loader reuses a buffer
only when nothing references it, so no buffer is overwritten early.

Checkpoint ``batches.state_dict()``, not the loader's: the loader is ``depth`` batches ahead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from tokenmill.errors import ConfigError
from tokenmill.loader import Loader

__all__ = ["JaxBatches", "to_jax"]


def to_jax(loader: Loader, sharding: jax.sharding.Sharding, *, depth: int = 2) -> JaxBatches:
    """The loader's batches as global ``jax.Array``s laid out by ``sharding``, ``depth`` ahead.

    to_jax(loader, sharding).global_shape == (loader.global_batch_size, loader.config.seq_len)
    """
    return JaxBatches(loader, sharding, depth=depth)


def _process_rows(sharding: jax.sharding.Sharding, shape: tuple[int, int]) -> tuple[int, int]:
    """The global batch rows [lo, hi) this process's devices hold; ConfigError if not one block."""
    rows = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows.update(range(*index[0].indices(shape[0])))
    lo, hi = min(rows), max(rows) + 1
    if len(rows) != hi - lo:
        raise ConfigError(f"this process's devices hold batch rows {sorted(rows)} of {shape[0]}, "
                          "not one contiguous block; order the mesh's devices by process "
                          "(jax.make_mesh does) so each process holds its own rank's rows")
    return lo, hi


class JaxBatches:
    """Iterable of a Loader's batches as dicts of global ``jax.Array``s; made by ``to_jax``.

    ``state_dict()`` counts only the batches handed out, so ``load_state_dict`` of it resumes
    exactly. ``close()`` closes the loader too.
    """

    def __init__(self, loader: Loader, sharding: jax.sharding.Sharding, *, depth: int = 2):
        if not isinstance(depth, int) or depth < 1:
            raise ConfigError(f"depth must be an int >= 1 (got depth={depth!r})")
        self.loader, self.sharding, self.depth = loader, sharding, depth
        B = loader.batch_size
        self.global_shape = (loader.global_batch_size, loader.config.seq_len)
        lo, hi = _process_rows(sharding, self.global_shape)
        if (lo, hi) != (loader.rank * B, (loader.rank + 1) * B):
            raise ConfigError(
                f"the sharding puts global batch rows [{lo}, {hi}) of {self.global_shape[0]} on "
                f"process {jax.process_index()}'s devices, but the loader (rank={loader.rank}, "
                f"world_size={loader.world_size}, batch_size={B}) holds rows "
                f"[{loader.rank * B}, {(loader.rank + 1) * B}); build it with "
                "Loader(..., rank=jax.process_index(), world_size=jax.process_count()) for a "
                "mesh whose batch axis spans all processes")
        self._consumed = loader.consumed_samples
        self._iterating: object | None = None

    def __len__(self) -> int:
        """Steps per epoch, as the loader's."""
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, jax.Array]]:
        self.loader.load_state_dict(self.state_dict())  # drop what a previous pass took ahead
        self._iterating = token = object()
        return self._batches(token)

    def _batches(self, token) -> Iterator[dict[str, jax.Array]]:
        ahead: deque[tuple[dict[str, jax.Array], int]] = deque()
        source = iter(self.loader)
        while True:
            while len(ahead) < self.depth and (arrays := next(source, None)) is not None:
                ahead.append((self._put(arrays), self.loader.consumed_samples))
                del arrays  # JAX holds it until the transfer is done; then the loader may reuse it
            if not ahead:
                return
            arrays, consumed = ahead.popleft()
            if self._iterating is not token:
                return
            self._consumed = consumed
            yield arrays

    def _put(self, arrays: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """Start the transfer of this process's arrays into global arrays (asynchronous)."""
        return {k: jax.make_array_from_process_local_data(self.sharding, a, self.global_shape)
                for k, a in arrays.items()}

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

    def __enter__(self) -> JaxBatches:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
