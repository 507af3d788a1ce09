"""Context parallelism in torch (``integrations.torchcp``): a to_torch batch's CP share is the
numpy one's, as tensors; FlexAttention of each CP rank's queries over the keys/values gathered from
every CP rank (``cp_document_mask``) equals FlexAttention of the unsplit batch (fp64, ≤ 1e-9)."""

import warnings

import numpy as np
import pytest
import torch
from conftest import write_positional_store
from torch.nn.attention.flex_attention import flex_attention

from tokenmill.integrations.torch import document_mask, to_torch
from tokenmill.integrations.torchcp import cp_batch, cp_document_mask
from tokenmill.load import cpsplit
from tokenmill.load.loader import Loader

L, B, HEADS, DIM = 64, 2, 2, 8


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    lengths = np.minimum(3 * L, 1 + np.random.default_rng(3).lognormal(2.5, 1.2, 300).astype(int))
    return write_positional_store(tmp_path_factory.mktemp("tcp") / "s", lengths)


SETUPS = [({"layout": "packed"}, None), ({"layout": "packed", "max_segments": 4}, 4),
          ({"document_masks": True}, None), ({}, None)]


def torch_batches(store, kw, steps):
    """The first batches of to_torch on CPU, cloned (the loader reuses its buffers)."""
    with to_torch(Loader(store, seq_len=L, batch_size=B, seed=2, num_workers=0, dtype="int64",
                         **kw)) as batches:
        it = iter(batches)
        return [{k: v.clone() for k, v in next(it).items()} for _ in range(steps)]


def unsplit_mask(batch):
    """The whole batch's causal document BlockMask (a concat batch: one document a row)."""
    ones = {"segment_ids": torch.ones(B, L, dtype=torch.int32)}
    return document_mask(batch if "segment_ids" in batch else ones)


@pytest.mark.parametrize("kw, cap", SETUPS)
def test_a_torch_batch_share_is_the_numpy_share_as_tensors(store, kw, cap):
    for batch in torch_batches(store, kw, 3):
        host = {k: v.numpy() for k, v in batch.items()}
        for r in range(2):
            got = cp_batch(batch, cp=2, cp_rank=r, max_segments=cap)
            want = cpsplit.cp_batch(host, cp=2, cp_rank=r, max_segments=cap)
            assert got.arrays.keys() == want.arrays.keys()
            for k in want.arrays:
                assert got.arrays[k].dtype == batch[k].dtype
                assert np.array_equal(got.arrays[k].numpy(), want.arrays[k])
            for field, value in want._asdict().items():
                if field != "arrays":
                    assert np.array_equal(np.asarray(getattr(got, field)), value), field


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("kw, cap", SETUPS)
def test_flex_attention_over_gathered_keys_equals_the_unsplit_flex_attention(store, kw, cap, cp):
    gen = torch.Generator().manual_seed(cp)
    for batch in torch_batches(store, kw, 2):
        q, k, v = (torch.randn(B, HEADS, L, DIM, generator=gen, dtype=torch.float64)
                   for _ in range(3))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "not compiled" on CPU
            whole = flex_attention(q, k, v, block_mask=unsplit_mask(batch))
            flat = [x.transpose(1, 2).reshape(B * L, HEADS, DIM) for x in (q, k, v, whole)]
            shares = [cp_batch(batch, cp=cp, cp_rank=r, max_segments=cap) for r in range(cp)]
            # what an all-gather of each rank's (C, heads, dim) slots gives: garbage on padding
            gathered = [torch.cat([torch.where((s.index >= 0)[:, None, None],
                                               x[s.index.clamp(min=0)], 1e3) for s in shares])
                        for x in flat[1:3]]
            for s in shares:
                mine = flat[0][s.index.clamp(min=0)]
                out = flex_attention(*(x.transpose(0, 1)[None] for x in (mine, *gathered)),
                                     block_mask=cp_document_mask(s))[0].transpose(0, 1)
                real = s.index >= 0
                assert torch.isfinite(out).all()
                assert (out[real] - flat[3][s.index[real]]).abs().max() <= 1e-9
