"""PyTorch: a Loader's batches as tensors on a device, and as an IterableDataset for DataLoader.

    batches = to_torch(Loader("store/", seq_len=2048, batch_size=8), device="cuda")
    for batch in batches:                    # batch["inputs"]: torch.int32 (8, 2048) on cuda
        state = batches.state_dict()         # save this one, not the loader's: see below

``to_torch`` on CPU hands out tensors that share the loader's batch buffers (``torch.from_numpy``,
no copy; a buffer is reused once nothing holds its memory, also through ``t.detach()`` or
``t.numpy()``; its iterator is a pass of the loader's own,
``loader.iterate(view=torch.from_numpy)``, and the loader iterated itself hands out arrays as
ever). On CUDA it keeps ``depth`` batches in flight: each is copied by the host into a pinned
buffer of a small ring and sent by a non-blocking copy on a side stream, so batch k+1 crosses PCIe
while step k runs. The compute stream waits on the copy's event (the host does not),
``record_stream`` keeps the caching allocator from reusing a batch's device memory before the
compute stream is done with it, and a pinned buffer is refilled only after the host has
synchronized on the event of the copy that read it last. Because batches are taken from the loader
ahead of the training step, the wrapper, not the loader, knows which batches were handed out:
checkpoint ``batches.state_dict()``.

``TokenDataset`` keeps existing ``torch.utils.data.DataLoader(ds, batch_size=None,
num_workers=N, pin_memory=True, persistent_workers=True)`` code: worker w of N computes steps
w, w+N, w+2N, … and DataLoader takes one item from each worker in turn, so the order is the
loader's own for any N. Its ``state_dict``/``load_state_dict`` let
``torchdata.stateful_dataloader.StatefulDataLoader`` resume exactly.

Rank and world size come from ``torch.distributed`` when it is initialised (the Loader reads them
when it is built: build it after ``init_process_group``).

Packed batches (``layout="packed"``) in each attention kernel's form, built by the numpy rules of
``tokenmill.load.attention`` (padding joins the document before it in its row; its loss_mask is 0):
``document_mask(batch)`` → a FlexAttention causal document ``BlockMask``;
``dense_document_mask(batch)`` → (B, 1, L, L) bool for ``scaled_dot_product_attention``;
``varlen_args(batch, pad_to=)`` → FlashAttention varlen ``cu_seqlens`` (int32) and ``max_seqlen``;
``flat_position_ids(batch)`` → Hugging Face flattening ``position_ids``; ``hf_inputs(batch)`` →
the whole keyword arguments of a Hugging Face causal LM. Each reads ``batch["segment_ids"]`` on
the host (free on CPU; one small copy from a GPU).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import time
import weakref
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from tokenmill.load import attention
from tokenmill.base.errors import ConfigError
from tokenmill.load.device import AheadOfLoader
from tokenmill.load.lengthplan import one_shape
from tokenmill.load.loader import STATE_VERSION, Loader
from tokenmill.load.resume import consumed_from
from tokenmill.store.reader import TokenStore

__all__ = ["TokenDataset", "TorchBatches", "dense_document_mask", "document_mask",
           "flat_position_ids", "hf_inputs", "to_torch", "varlen_args"]


def to_torch(loader: Loader, device: str | torch.device = "cpu", *, depth: int = 2) -> TorchBatches:
    """The loader's batches as tensors on ``device``; on CUDA, ``depth`` copies run ahead.

    next(iter(to_torch(loader)))["inputs"].dtype == torch.int32   # for Loader(dtype="int32")
    """
    device = torch.device(device)
    if device.type == "cuda":
        return TorchBatches(loader, device, ops=_Cuda(device), depth=depth)
    return TorchBatches(loader, device, ops=None, depth=depth)


class _Device(Protocol):
    """The stream operations of the pinned-copy pipeline: ``_Cuda`` on a GPU, a fake in tests."""

    def pinned(self, like: torch.Tensor) -> torch.Tensor:
        """A page-locked host tensor of the shape and dtype of ``like``."""

    def stream(self) -> AbstractContextManager:
        """A context in which work is issued on the side (copy) stream."""

    def copy(self, host: torch.Tensor) -> torch.Tensor:
        """A non-blocking host-to-device copy of ``host``, issued on the current stream."""

    def record(self) -> Any:
        """An event that completes when the work issued so far on the side stream has."""

    def wait(self, event: Any) -> None:
        """Make the compute (current) stream wait for ``event``; the host does not wait."""

    def synchronize(self, event: Any) -> None:
        """Block the host until ``event`` has completed."""

    def keep(self, tensor: torch.Tensor) -> None:
        """``tensor`` (allocated on the side stream) is used on the compute stream from now on."""


class _Cuda:
    """``_Device`` for one CUDA device, with its own side stream for host-to-device copies."""

    def __init__(self, device: torch.device):
        if not torch.cuda.is_available():
            raise ConfigError(f"device={str(device)!r} but torch.cuda.is_available() is False "
                              f"(torch {torch.__version__}); use device='cpu' or a CUDA build")
        self.device = torch.device("cuda", torch.cuda.current_device()
                                   if device.index is None else device.index)
        self.side = torch.cuda.Stream(self.device)

    def pinned(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)

    def stream(self) -> AbstractContextManager:
        return torch.cuda.stream(self.side)

    def copy(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True)

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.side)
        return event

    def wait(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def keep(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(torch.cuda.current_stream(self.device))


class _Slot:
    """One pinned host buffer set and the event of the last copy that read from it."""

    def __init__(self, ops: _Device, arrays: Mapping[str, np.ndarray]):
        self.host = {k: ops.pinned(torch.from_numpy(a)) for k, a in arrays.items()}
        self.event = None


class TorchBatches(AheadOfLoader):
    """Iterable of a Loader's batches as dicts of tensors on one device; made by ``to_torch``.

    ``state_dict()`` counts only the batches handed out, not those still in flight, so
    ``load_state_dict`` of it resumes exactly. ``close()`` closes the loader too.
    """

    def __init__(self, loader: Loader, device: torch.device, *, ops: _Device | None, depth: int = 2):
        super().__init__(loader, depth)
        self.device = torch.device(device)
        self._ops = ops
        self._slots: list[_Slot] = []  # depth + 1: the oldest is refilled while depth are in flight

    def _pass(self, token) -> Iterator[dict[str, torch.Tensor]]:
        """The pass's tensors: the loader's own on CPU (no copy), else copied to the device."""
        if self._cpu:  # no batch in flight: the loader's own iterator, handing out tensors
            return self._handed(token, self.loader.iterate(view=torch.from_numpy))  # no copy
        if self._ops is None:
            return self._direct(token)
        return self._pipelined(token)

    @property
    def _cpu(self) -> bool:
        return self._ops is None and self.device.type == "cpu"

    def state_dict(self) -> dict[str, Any]:
        """The loader's state as of the last batch handed out (in-flight ones excluded)."""
        if self._cpu:  # nothing in flight: the loader's count is what was handed out
            return self.loader.state_dict()
        return super().state_dict()

    def _handed(self, token, batches: Iterator) -> Iterator[dict[str, torch.Tensor]]:
        """``batches`` of the loader, each counted as handed out by the pass ``token``."""
        for tensors in batches:
            self._hand_out(token, self.loader.consumed_samples)
            yield tensors
            del tensors  # the loader reuses a buffer only once nothing holds a view of it

    def _numpy(self) -> Iterator[tuple[dict[str, np.ndarray], int]]:
        """The loader's batches, each with the consumed_samples count once it is handed out."""
        for arrays in self.loader:
            yield arrays, self.loader.consumed_samples

    def _direct(self, token) -> Iterator[dict[str, torch.Tensor]]:
        """Another accelerator (mps, xpu, …): a plain, blocking copy of each batch."""
        for arrays, consumed in self._numpy():
            t0 = time.perf_counter()
            tensors = {k: torch.from_numpy(a).to(self.device) for k, a in arrays.items()}
            if self._spans is not None:
                self._spans("device copy", t0, time.perf_counter())
            self._hand_out(token, consumed)
            yield tensors

    def _pipelined(self, token) -> Iterator[dict[str, torch.Tensor]]:
        ops, ahead, issued = self._ops, deque(), 0
        source = self._numpy()
        while True:
            while len(ahead) < self.depth and (item := next(source, None)) is not None:
                arrays, consumed = item
                t0 = time.perf_counter()
                ahead.append((self._send(ops, arrays, issued), consumed))
                if self._spans is not None:  # the host's part: pinned copy, copy issued
                    self._spans("device copy", t0, time.perf_counter())
                issued += 1
                del arrays, item  # the loader may reuse its buffer once the host copy is done
            if not ahead:
                return
            (tensors, event), consumed = ahead.popleft()
            ops.wait(event)
            for t in tensors.values():
                ops.keep(t)
            self._hand_out(token, consumed)
            yield tensors

    def _send(self, ops: _Device, arrays: Mapping[str, np.ndarray], n: int):
        """Copy one batch into the next pinned slot and start its device copy on the side stream."""
        if not self._slots:
            self._slots = [_Slot(ops, arrays) for _ in range(self.depth + 1)]
        slot = self._slots[n % len(self._slots)]
        if slot.event is not None:
            ops.synchronize(slot.event)  # the copy that last read this buffer has finished
        if any(slot.host[k].shape != a.shape for k, a in arrays.items()):  # a schedule's phase
            slot = self._slots[n % len(self._slots)] = _Slot(ops, arrays)
        for k, a in arrays.items():
            slot.host[k].copy_(torch.from_numpy(a))
        with ops.stream():
            tensors = {k: ops.copy(h) for k, h in slot.host.items()}
        slot.event = ops.record()
        return tensors, slot.event

    def close(self) -> None:
        """Close the loader and drop the pinned buffers; safe to call twice."""
        super().close()
        self._slots = []


def _loader_spec(loader: Loader) -> dict[str, Any]:
    """What rebuilds ``loader`` anywhere (rank and world size as resolved here): how to open its
    stores (paths and options, never the loader's own TokenStore objects, which its ``close()``
    closes) and its settings."""
    stores = tuple(s.store.open_args() for s in loader.plan.sources)
    names = [a["path"] for a in stores]
    if len(set(names)) != len(names):
        raise ConfigError(f"a TokenDataset mixture needs distinct store paths (got {names})")
    named = loader.plan.mixture.named
    return {"stores": stores, "weights": tuple(loader.weights), "seq_len": loader.config.seq_len,
            "names": loader.plan.mixture.names if named else None,
            "mixture": loader.describe()["mixture"],
            "batch_size": loader.batch_size, "layout": loader.config.layout,
            "seed": loader.config.seed, "max_segments": loader.config.max_segments,
            "document_masks": loader.config.document_masks, "thd": loader.options.thd,
            "rank": loader.rank, "world_size": loader.world_size,
            "epochs": loader.epochs, "dtype": loader.plan.dtype.name}


def _open_loader(spec: Mapping[str, Any]) -> Loader:
    """A Loader (inline: no workers of its own) over stores it opens from ``spec``; they are
    closed when the Loader is garbage-collected."""
    settings = {k: v for k, v in spec.items() if k not in ("stores", "weights", "names")}
    stores = []
    try:
        for args in spec["stores"]:
            stores.append(TokenStore(**args))
        source = dict(zip(spec["names"], stores)) if spec["names"] else \
            dict(zip(stores, spec["weights"]))
        loader = Loader(source, **settings, num_workers=0)
    except BaseException:
        _close_all(stores)
        raise
    weakref.finalize(loader, _close_all, stores)
    return loader


def _close_all(stores: list[TokenStore]) -> None:
    for store in stores:
        store.close()


class TokenDataset(IterableDataset):
    """A Loader's batches as an IterableDataset for ``DataLoader(ds, batch_size=None, ...)``.

    Worker w of N takes steps w, w+N, …; DataLoader interleaves its workers in order, so the
    stream equals ``loader``'s for any num_workers. Each pass (each ``for`` over the DataLoader)
    starts where the dataset stands: at the loader's position when wrapped, or at a loaded state.

    state_dict(): ``{"version", "consumed_samples", "fingerprint", "stream"}`` as the Loader's; inside a
    DataLoader worker it also holds ``worker`` and ``num_workers``, and ``consumed_samples`` is
    where that worker's next step starts (StatefulDataLoader keeps one such state per worker).
    """

    def __init__(self, loader: Loader):
        super().__init__()
        one_shape(loader.seq_len_schedule, "TokenDataset")  # its workers step by one batch size
        loader.check_ranks()  # here, on every rank: DataLoader workers take no part in collectives
        self._spec = _loader_spec(loader)
        self.fingerprint = loader.fingerprint
        self._stream = loader.describe()  # what the stream depends on, for explained resumes
        self.global_batch_size = loader.global_batch_size
        self.total_steps = loader.total_steps
        self._start = loader.consumed_samples  # where a pass starts …
        self._own = False  # … for the whole stream (False) or for this worker alone (True)
        self._next: int | None = None  # where this copy's next step starts, during a pass
        self._loader: Loader | None = None
        self._pid: int | None = None

    def __len__(self) -> int:
        """Steps from the start position to the end of the loader's ``epochs``."""
        if self.total_steps is None:
            raise TypeError("a TokenDataset over Loader(epochs=None) is endless and has no len()")
        end = self.total_steps * self.global_batch_size
        return max(0, (end - self._start) // self.global_batch_size)

    def _get_loader(self) -> Loader:
        if self._loader is None or self._pid != os.getpid():  # fresh in each worker process
            self._loader = _open_loader(self._spec)
            self._pid = os.getpid()
            if self._loader.fingerprint != self.fingerprint:
                raise ConfigError(f"the stores changed since the TokenDataset was made: fingerprint "
                                  f"{self._loader.fingerprint!r}, expected {self.fingerprint!r}")
        return self._loader

    def _first(self) -> int:
        if self._own:
            return self._start
        info = get_worker_info()
        return self._start + (0 if info is None else info.id) * self.global_batch_size

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        stride = (1 if info is None else info.num_workers) * self.global_batch_size
        end = None if self.total_steps is None else self.total_steps * self.global_batch_size
        loader = self._get_loader()
        self._next = self._first()
        while end is None or self._next + self.global_batch_size <= end:
            consumed = self._next
            self._next += stride  # before the yield: a state taken now counts this batch
            yield {k: torch.from_numpy(a) for k, a in loader.batch_at(consumed).items()}

    def state_dict(self) -> dict[str, Any]:
        """Where this copy's next step starts (see the class docstring)."""
        state = {"version": STATE_VERSION, "fingerprint": self.fingerprint,
                 "consumed_samples": int(self._first() if self._next is None else self._next),
                 "stream": self._stream}
        if (info := get_worker_info()) is not None:
            state.update(worker=info.id, num_workers=info.num_workers)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Start the next pass at ``state``: a Loader's or TokenDataset's, or one worker's own."""
        consumed = consumed_from(state, self._stream, self.fingerprint)
        own = "worker" in state
        if own:
            info = get_worker_info()
            here = None if info is None else (info.id, info.num_workers)
            if here != (state["worker"], state.get("num_workers")):
                raise ConfigError(f"this state belongs to DataLoader worker {state['worker']} of "
                                  f"{state.get('num_workers')}, not to {here or 'the main process'}; "
                                  "restore it through the StatefulDataLoader that saved it")
        self._start, self._own, self._next = consumed, own, None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_loader": None, "_pid": None}


# ---- packed batches → attention kernels --------------------------------------------------------

def _segment_ids(batch) -> tuple[np.ndarray, torch.device]:
    """The batch's segment_ids as a host numpy array, and the device they came from."""
    seg = batch["segment_ids"] if isinstance(batch, Mapping) else batch
    if isinstance(seg, torch.Tensor):
        return seg.cpu().numpy(), seg.device
    return np.asarray(seg), torch.device("cpu")


def dense_document_mask(batch) -> torch.Tensor:
    """(B, 1, L, L) bool causal document mask for ``scaled_dot_product_attention(attn_mask=)``.

    dense_document_mask({"segment_ids": torch.tensor([[1, 2]])})[0, 0].diag().all()
    """
    seg, device = _segment_ids(batch)
    return torch.from_numpy(attention.document_mask(seg))[:, None].to(device)


def document_mask(batch, *, block_size: int = 128):
    """A FlexAttention ``BlockMask``: token q attends to k ⇔ k <= q in the same document.

    flex_attention(q, k, v, block_mask=document_mask(batch))   # q: (B, heads, L, dim)
    """
    from torch.nn.attention.flex_attention import create_block_mask
    seg, device = _segment_ids(batch)
    seq = torch.from_numpy(attention.sequence_ids(seg)).to(device)
    B, L = seq.shape

    def causal_document(b, h, q, k):
        return (seq[b, q] == seq[b, k]) & (k <= q)

    return create_block_mask(causal_document, B, None, L, L, device=str(device),
                             BLOCK_SIZE=block_size)


def varlen_args(batch, *, pad_to: int | None = None) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32 on the batch's device, max_seqlen) for FlashAttention varlen over the
    batch flattened to (B·L, heads, dim); ``pad_to`` slots keep the shape static (see
    ``tokenmill.load.attention.varlen_slots``).

    varlen_args({"segment_ids": torch.tensor([[1, 1, 2, 0]])})[0].tolist() == [0, 2, 4]
    """
    seg, device = _segment_ids(batch)
    cu, max_seqlen = attention.varlen_args(seg, pad_to=pad_to)
    return torch.from_numpy(cu).to(device), max_seqlen


def flat_position_ids(batch) -> torch.Tensor:
    """(B, L) int64 position_ids restarting at each document (HF ``DataCollatorWithFlattening``);
    pass ``.reshape(1, -1)`` with the inputs reshaped the same way.

    flat_position_ids({"segment_ids": torch.tensor([[1, 1, 2, 0]])}).tolist() == [[0, 1, 0, 1]]
    """
    seg, device = _segment_ids(batch)
    return torch.from_numpy(attention.flat_position_ids(seg)).to(device)


# ---- batches → a Hugging Face causal LM --------------------------------------------------------

# 4.54 is the first transformers whose sdpa/eager/flex masks follow packed position_ids
# (masking_utils.find_packed_sequence_indices): Llama, Qwen2, Mistral leak on 4.53, exact on 4.54
HF_MIN_VERSION = (4, 54)
IGNORE_INDEX = -100  # what HF's cross entropy skips


def hf_inputs(batch) -> dict[str, Any]:
    """The keyword arguments of a Hugging Face causal LM (transformers >= 4.54) for a batch.

    Packed: the rows flattened to one of B·L tokens, ``position_ids`` restarting at every
    document (HF then attends within documents only), ``shift_labels`` = the targets (-100 where
    ``loss_mask`` is 0), ``labels`` the same in HF's unshifted form, ``use_cache=False`` (with a
    cache transformers builds no packed mask). Concat: the rows as they are, no position_ids.

    model(**hf_inputs(batch)).loss    # == mean of -log p(target) over loss_mask
    """
    _check_transformers()
    if not isinstance(batch, Mapping) or not {"inputs", "targets"} <= batch.keys():
        raise ConfigError(f"hf_inputs takes a batch of a tokenmill Loader (a dict with 'inputs' "
                          f"and 'targets'; got {type(batch).__name__}); pass the batch itself")
    inputs, targets = _tensor(batch["inputs"]), _tensor(batch["targets"])
    shift = targets.to(torch.int64)
    if "loss_mask" in batch:
        shift = shift.masked_fill(_tensor(batch["loss_mask"]).to(shift.device) == 0, IGNORE_INDEX)
    ids = inputs.to(torch.int64)
    kwargs = {}
    if "segment_ids" in batch:  # packed: one row, every document starting at position 0
        ids, shift = ids.reshape(1, -1), shift.reshape(1, -1)
        kwargs["position_ids"] = flat_position_ids(batch).reshape(1, -1)
    labels = torch.nn.functional.pad(shift[:, :-1], (1, 0), value=IGNORE_INDEX)  # HF shifts it
    return {"input_ids": ids, **kwargs, "labels": labels, "shift_labels": shift,
            "use_cache": False}


def _tensor(value) -> torch.Tensor:
    """A batch entry as a tensor (numpy arrays of the Loader's own batches shared, not copied)."""
    return value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))


@functools.cache
def _transformers_version() -> str | None:
    """The installed transformers' version (read once: a metadata lookup costs ~3 ms)."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None  # the kwargs are plain tensors; whatever takes them is the caller's


def _check_transformers() -> None:
    """Refuse an installed transformers too old to keep packed documents apart."""
    version = _transformers_version()
    if version and tuple(int(n) for n in re.findall(r"\d+", version)[:2]) < HF_MIN_VERSION:
        raise ConfigError(f"transformers {version} is installed: before 4.54 its sdpa and eager "
                          "attention ignore packed position_ids and let documents attend to "
                          "each other; pip install 'transformers>=4.54'")
