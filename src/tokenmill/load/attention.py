"""Packed rows → what each attention kernel takes, as pure numpy (no torch, no jax).

A packed batch (``Loader(..., layout="packed")``) has ``segment_ids`` (B, L): 1, 2, … for the
documents (or pieces of long documents) of a row, 0 on padding, which the packer puts only at the
end of a row. Every kernel form below is built from one rule, ``sequence_ids``:

* a row is cut into *attention sequences*, one per segment; a token attends to the earlier tokens
  of its own sequence and to itself (causal, never across documents, never across rows);
* padding joins the sequence before it in its row. It comes after that document, so causality
  keeps every real token from seeing it; padding tokens see that document, but their
  ``loss_mask`` is 0, so they change no loss. (A row that starts with padding — never made by the
  packer — is one sequence of padding.) This keeps the number of sequences equal to the number of
  segments, which bounds ``cu_seqlens`` (see ``varlen_slots``), and leaves no query row with
  nothing to attend to (no NaN from a fully masked softmax row).

Forms: FlashAttention varlen ``cu_seqlens`` + ``max_seqlen`` (``varlen_args``, optionally a fixed
number of slots for static shapes), Hugging Face flattening ``position_ids`` restarting at every
sequence (``flat_position_ids``), and a dense boolean causal document mask (``document_mask``) for
``scaled_dot_product_attention`` / ``jax.nn.dot_product_attention`` on small shapes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tokenmill.base.errors import ConfigError, check_int

__all__ = ["VarlenArgs", "document_mask", "flat_position_ids", "sequence_ids", "sequence_starts",
           "varlen_args", "varlen_slots"]


def _segments(segment_ids) -> np.ndarray:
    seg = np.asarray(segment_ids)
    if seg.ndim != 2 or seg.dtype.kind not in "iu":
        raise ConfigError(f"segment_ids must be a 2-d integer array (batch, seq_len) (got "
                          f"{seg.dtype}, shape {seg.shape}); pass batch['segment_ids'] of a "
                          "Loader(..., layout='packed')")
    return seg


def sequence_starts(segment_ids) -> np.ndarray:
    """(B, L) bool: True where an attention sequence starts (row start, or a new segment).

    sequence_starts([[1, 1, 2, 0]]).tolist() == [[True, False, True, False]]
    """
    seg = _segments(segment_ids)
    starts = np.ones(seg.shape, dtype=bool)
    starts[:, 1:] = (seg[:, 1:] != seg[:, :-1]) & (seg[:, 1:] != 0)  # padding joins the one before
    return starts


def sequence_ids(segment_ids) -> np.ndarray:
    """(B, L) int32: 1-based attention sequence of each token in its row; padding joins the last.

    sequence_ids([[1, 1, 2, 0]]).tolist() == [[1, 1, 2, 2]]
    """
    return np.cumsum(sequence_starts(segment_ids), axis=1, dtype=np.int32)


def document_mask(segment_ids) -> np.ndarray:
    """(B, L, L) bool: query i may attend to key j ⇔ j <= i and both are in the same sequence.

    document_mask([[1, 2]])[0].tolist() == [[True, False], [False, True]]
    """
    seq = sequence_ids(segment_ids)
    L = seq.shape[1]
    causal = np.tri(L, dtype=bool)
    return (seq[:, :, None] == seq[:, None, :]) & causal


def flat_position_ids(segment_ids) -> np.ndarray:
    """(B, L) int64 positions restarting at 0 at each sequence (DataCollatorWithFlattening's
    convention; padding keeps counting after its document, so it starts no sequence of its own).
    Reshape to (1, B·L) with the inputs for an HF model: every row starts at position 0.

    flat_position_ids([[1, 1, 2, 0]]).tolist() == [[0, 1, 0, 1]]
    """
    starts = sequence_starts(segment_ids)
    idx = np.broadcast_to(np.arange(starts.shape[1], dtype=np.int64), starts.shape)
    first = np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
    return idx - first


class VarlenArgs(NamedTuple):
    """FlashAttention varlen arguments for the batch flattened to (B·L, heads, dim)."""

    cu_seqlens: np.ndarray  # int32[n + 1]: offsets of the sequences, then B·L (repeated to pad)
    max_seqlen: int  # the longest sequence


def varlen_slots(batch_size: int, max_segments: int) -> int:
    """Slots of a fixed-size ``cu_seqlens``: batch_size × max_segments + 1 (one offset per
    sequence, at most max_segments per row by the packer's cap, plus the final B·L). Without a
    cap, max_segments = seq_len bounds it (a row of L inputs holds at most L sequences).

    varlen_slots(8, 4) == 33
    """
    return check_int("batch_size", batch_size, minimum=1) * \
        check_int("max_segments", max_segments, minimum=1) + 1


def varlen_args(segment_ids, *, pad_to: int | None = None) -> VarlenArgs:
    """``cu_seqlens`` (int32) and ``max_seqlen`` of the batch flattened row after row; with
    ``pad_to``, exactly that many slots, padded by repeating the last offset (empty sequences),
    so the shape is static under torch.compile / CUDA graphs (``varlen_slots`` gives the bound).

    varlen_args([[1, 1, 2, 0]], pad_to=4).cu_seqlens.tolist() == [0, 2, 4, 4]
    """
    starts = sequence_starts(segment_ids)
    total = starts.size
    if total >= 2**31:
        raise ConfigError(f"batch of {total:,} tokens: cu_seqlens is int32, keep B·L < 2**31")
    cu = np.append(np.flatnonzero(starts.ravel()), total).astype(np.int32)
    max_seqlen = int(np.diff(cu).max(initial=0))
    if pad_to is not None:
        if len(cu) > pad_to:
            raise ConfigError(f"this batch has {len(cu) - 1} sequences, which needs "
                              f"{len(cu)} cu_seqlens slots, more than pad_to={pad_to}; use "
                              "pad_to=varlen_slots(batch_size, max_segments) with the "
                              "Loader's max_segments")
        cu = np.concatenate([cu, np.full(pad_to - len(cu), total, dtype=np.int32)])
    return VarlenArgs(cu, max_seqlen)
