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

Packed batches (``layout="packed"``) carry ``segment_ids`` and ``positions`` (int32) as global
arrays like the rest; on the devices, ``document_mask(batch)`` is the (B, 1, L, L) bool ``mask``
of ``jax.nn.dot_product_attention`` and ``sequence_ids(batch)`` the segment ids splash attention
takes (``SegmentIds(q=ids, kv=ids)``), both jittable.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from tokenmill.base.errors import ConfigError
from tokenmill.load.device import AheadOfLoader
from tokenmill.load.lengthplan import one_shape
from tokenmill.load.loader import Loader

__all__ = ["JaxBatches", "document_mask", "sequence_ids", "to_jax"]


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


class JaxBatches(AheadOfLoader):
    """Iterable of a Loader's batches as dicts of global ``jax.Array``s; made by ``to_jax``.

    ``state_dict()`` counts only the batches handed out, so ``load_state_dict`` of it resumes
    exactly. ``close()`` closes the loader too.
    """

    def __init__(self, loader: Loader, sharding: jax.sharding.Sharding, *, depth: int = 2):
        one_shape(loader.seq_len_schedule, "to_jax")  # one global shape, made once
        if loader.options.thd:  # cu_seqlens index one process's rows: no global array of them
            raise ConfigError("to_jax makes global (batch, seq_len) arrays, and thd=True's "
                              "cu_seqlens index this process's rows alone: drop thd=True (JAX "
                              "attention takes the mask of tokenmill.jax.sequence_ids)")
        super().__init__(loader, depth)
        self.sharding = sharding
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

    def _pass(self, token) -> Iterator[dict[str, jax.Array]]:
        """The pass's global arrays, ``depth`` transfers ahead."""
        ahead: deque[tuple[dict[str, jax.Array], int]] = deque()
        source = iter(self.loader)
        while True:
            while len(ahead) < self.depth and (arrays := next(source, None)) is not None:
                ahead.append((self._put(arrays), self.loader.consumed_samples))
                del arrays  # JAX holds it until the transfer is done; then the loader may reuse it
            if not ahead:
                return
            arrays, consumed = ahead.popleft()
            self._hand_out(token, consumed)
            yield arrays

    def _put(self, arrays: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """Start the transfer of this process's arrays into global arrays (asynchronous)."""
        return {k: jax.make_array_from_process_local_data(self.sharding, a, self.global_shape)
                for k, a in arrays.items()}


def sequence_ids(batch) -> jax.Array:
    """(B, L) int32 document of each token, 1-based in its row; padding joins the one before.

    The rule of ``tokenmill.load.attention.sequence_ids``, in jnp so it runs on the devices (jittable).
    sequence_ids({"segment_ids": jnp.array([[1, 1, 2, 0]])}).tolist() == [[1, 1, 2, 2]]
    """
    seg = jnp.asarray(batch["segment_ids"] if isinstance(batch, Mapping) else batch)
    new = (seg[:, 1:] != seg[:, :-1]) & (seg[:, 1:] != 0)
    starts = jnp.concatenate([jnp.ones_like(seg[:, :1], dtype=bool), new], axis=1)
    return jnp.cumsum(starts, axis=1, dtype=jnp.int32)


def document_mask(batch) -> jax.Array:
    """(B, 1, L, L) bool ``mask`` for ``jax.nn.dot_product_attention``: causal, within a document.

    jax.nn.dot_product_attention(q, k, v, mask=document_mask(batch))   # q: (B, L, heads, dim)
    """
    seq = sequence_ids(batch)
    L = seq.shape[1]
    causal = jnp.tril(jnp.ones((L, L), dtype=bool))
    return ((seq[:, :, None] == seq[:, None, :]) & causal)[:, None]
