"""Context parallelism in PyTorch: a batch's share for one CP rank as tensors on the batch's
device, and the FlexAttention mask of its queries over the keys/values all-gathered from every CP
rank. The split is ``tokenmill.load.cpsplit``'s (numpy, per document head–tail); this module
takes the tokens with it on the device and builds the kernel's arguments there.

    batch = next(iter(to_torch(loader, device="cuda")))   # the same on every CP rank
    share = cp_batch(batch, cp=2, cp_rank=r)               # share.arrays["inputs"]: (C,) on cuda
    k_all = all_gather(k)                                  # (1, heads, 2·C, dim), rank-major
    out = flex_attention(q, k_all, v_all, block_mask=cp_document_mask(share))

The split reads ``segment_ids`` on the host (one small copy from a GPU, as
``integrations.torch.document_mask`` does).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from tokenmill.load.cpsplit import CPBatch, cp_layout

__all__ = ["cp_batch", "cp_document_mask"]


def cp_batch(batch: Mapping[str, torch.Tensor], *, cp: int, cp_rank: int,
             max_segments: int | None = None) -> CPBatch:
    """``tokenmill.load.cpsplit.cp_batch`` of a batch of tensors: every array of the share a
    tensor on the batch's device (the tokens taken there), ``max_seqlen_*`` ints.

    cp_batch({"inputs": torch.arange(8)[None]}, cp=2, cp_rank=0).arrays["inputs"].tolist() \
        == [0, 1, 6, 7]
    """
    inputs = torch.as_tensor(batch["inputs"])
    seg = batch.get("segment_ids")
    host = None if seg is None else torch.as_tensor(seg).cpu().numpy()
    share = cp_layout(tuple(inputs.shape), host, cp=cp, cp_rank=cp_rank,
                      max_segments=max_segments)
    on = {k: torch.from_numpy(v).to(inputs.device) for k, v in share._asdict().items()
          if isinstance(v, np.ndarray)}
    real, taken = on["index"] >= 0, on["index"].clamp(min=0)
    arrays = {k: torch.where(real, torch.as_tensor(t).reshape(-1)[taken], 0)
              for k, t in batch.items()}
    return share._replace(arrays=arrays, **on)


def cp_document_mask(share: CPBatch, *, block_size: int = 128):
    """A FlexAttention ``BlockMask`` for one CP rank's queries (C) over the all-gathered keys
    (cp·C): query q sees key k ⇔ same sequence and k's place in the batch <= q's (padding sees
    padding only), on the share's device.

    flex_attention(q, k_all, v_all, block_mask=cp_document_mask(share))  # q: (1, heads, C, dim)
    """
    from torch.nn.attention.flex_attention import create_block_mask
    seq, gseq, index, gindex = (torch.as_tensor(a) for a in (
        share.sequence_ids, share.gathered_sequence_ids, share.index, share.gathered_index))

    def causal_document(b, h, q, k):
        return (seq[q] == gseq[k]) & (gindex[k] <= index[q])

    return create_block_mask(causal_document, 1, None, len(seq), len(gseq),
                             device=str(seq.device), BLOCK_SIZE=block_size)
