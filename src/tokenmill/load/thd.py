"""Token-budget batches in the THD layout (issue 25): ``Loader(..., thd=True)`` adds the varlen
arguments of FlashAttention (``flash_attn_varlen_func``) and TransformerEngine / Megatron-LM
(``qkv_format="thd"``, ``PackedSeqParams``) to every batch.

A THD microbatch is a run of documents up to a token budget, back to back, with ``cu_seqlens``
marking where each starts. A packed row of ``seq_len = budget`` already is one: the packed plan
fills it with whole documents up to the budget (best fit within a window of documents), cuts a
document longer than the budget into pieces, and pads the rest. So THD here is a form of the
packed plan's batch, not a second plan: the rows, their order, the epoch's coverage (every
(input, target) pair once), resume and elastic resume are the packed layout's, and the state is
the same (a checkpoint of a loader with ``thd=True`` loads into one without, and back).
(``cpsplit.token_budget``'s in-order greedy runs would make step k depend on every document
before it: a scan of the epoch on every rank, which the plan's scale rule rules out.)::

    ld = Loader("store/", seq_len=8192, batch_size=1, layout="packed", max_segments=64,
                thd=True)
    batch = next(iter(ld))  # inputs, targets, positions, segment_ids, loss_mask: (1, 8192)
    batch["cu_seqlens"]  # int32 (65,): 0, …, 8192, then 8192 repeated (empty sequences)
    batch["max_seqlen"]  # int32 (): the longest sequence

``cu_seqlens`` are offsets into the batch flattened row after row (B·L tokens; batch_size > 1
is B budgets of L back to back), one sequence per segment, a row's padding joined to the
sequence before it (``attention.varlen_args``: causality keeps it from every real token, and its
``loss_mask`` is 0). Its length is fixed, B · S + 1 slots with S = ``max_segments`` (else
seq_len: a row of L inputs holds at most L sequences), so every batch has the same shapes for
torch.compile and CUDA graphs; the real offsets are ``cu[:np.searchsorted(cu, cu[-1]) + 1]``.
``positions`` restart at 0 at each segment (RoPE). With ``balance=…, microbatches=m`` each
microbatch (rows [i·B/m, (i+1)·B/m), near-equal attention work) has its own: ``cu_seqlens``
(m, B/m · S + 1) into its own rows flattened, ``max_seqlen`` (m,) — ``batch_size=m``: m budgets
a rank, one a microbatch. ``max_seqlen`` is at most seq_len, itself a valid bound for the
kernels when reading the array back from a device would cost a sync.

The two arrays are computed from the batch's own ``segment_ids`` when it is handed out (one
vectorised pass), in the consumer's thread, so inline, thread and process workers give the same
batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.base.errors import ConfigError, check_int
from tokenmill.load.attention import varlen_args, varlen_slots
from tokenmill.load.plan import LayoutConfig

__all__ = ["BatchForm", "batch_form"]


@dataclass(frozen=True)
class BatchForm:
    """What a Loader's batch holds beyond its rows: nothing (``slots`` None), or the THD
    ``cu_seqlens`` (``slots`` int32 offsets) and ``max_seqlen`` — of each of ``micro``
    microbatches when more than 1: arrays (micro, slots) and (micro,)."""

    slots: int | None = None
    micro: int = 1

    def buffers(self, bufs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``bufs`` (a batch's row arrays) with the form's own arrays added."""
        if self.slots is not None:
            lead = () if self.micro == 1 else (self.micro,)
            bufs["cu_seqlens"] = np.zeros((*lead, self.slots), np.int32)
            bufs["max_seqlen"] = np.zeros(lead, np.int32)
        return bufs

    def finish(self, bufs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``bufs`` with its form's arrays written from its filled ``segment_ids``.

        BatchForm(4).finish({"segment_ids": np.array([[1, 1, 2, 0]])})["cu_seqlens"].tolist() \
            == [0, 2, 4, 4]
        """
        if self.slots is None:
            return bufs
        if "cu_seqlens" not in bufs:  # batch_at(out=) of arrays the Loader did not make
            self.buffers(bufs)
        cu, longest = bufs["cu_seqlens"].reshape(self.micro, -1), bufs["max_seqlen"].reshape(-1)
        for i, rows in enumerate(np.split(bufs["segment_ids"], self.micro)):
            cu[i], longest[i] = varlen_args(rows, pad_to=self.slots)
        return bufs


def batch_form(thd: Any, config: LayoutConfig, batch_size: int | None, schedule: Any = None,
               microbatches: int = 1) -> BatchForm:
    """A Loader's ``thd`` setting checked against its layout: the rows' form alone (False), or
    with THD varlen arguments of (B / microbatches) · (max_segments or seq_len) + 1 slots each
    microbatch (True; ``balanced.balance_of`` has checked that microbatches divides B)."""
    if not isinstance(thd, bool):
        raise ConfigError(f"thd must be True or False (got thd={thd!r})")
    if not thd:
        return BatchForm()
    if schedule is not None:
        raise ConfigError("thd=True needs one batch shape for its fixed cu_seqlens: drop "
                          "seq_len_schedule, or compute each phase's cu_seqlens with "
                          "tokenmill.attention.varlen_args(batch['segment_ids'])")
    if config.layout != "packed" and not config.document_masks:
        raise ConfigError(f"thd=True needs the documents of each row: layout='packed' (a run "
                          "of documents up to seq_len tokens a row), or layout='concat' with "
                          f"document_masks=True (got layout={config.layout!r}); a plain concat "
                          "window is one sequence")
    rows = check_int("batch_size", batch_size, minimum=1) // microbatches
    return BatchForm(varlen_slots(rows, config.max_segments or config.seq_len), microbatches)
