"""Packed rows and concat windows with document masks → attention kernels, proven: a small causal
transformer gives every token the loss it gets when its document (the piece of it in the row) runs
alone, with each mask form; without the mask it does not."""

import warnings

import numpy as np
import pytest
from conftest import stdlib_texts, write_jsonl, write_token_store

from tokenmill.load import attention, pack
from tokenmill.base.errors import ConfigError

# ---- the numpy forms ----------------------------------------------------------------------------

ROWS = np.array([[1, 1, 1, 2, 2, 3, 0, 0],
                 [1, 1, 1, 1, 1, 1, 1, 1]], dtype=np.int32)


def test_sequences_follow_segments_and_padding_joins_the_one_before():
    assert attention.sequence_ids(ROWS).tolist() == [[1, 1, 1, 2, 2, 3, 3, 3], [1] * 8]
    # a row that starts with padding (the packer never makes one) is one sequence of padding
    assert attention.sequence_ids([[0, 0, 1, 1]]).tolist() == [[1, 1, 2, 2]]


def test_cu_seqlens_cover_the_flattened_batch_and_pad_with_the_last_offset():
    cu, max_seqlen = attention.varlen_args(ROWS)
    assert cu.dtype == np.int32 and cu.tolist() == [0, 3, 5, 8, 16]
    assert max_seqlen == 8
    padded = attention.varlen_args(ROWS, pad_to=attention.varlen_slots(2, 3))
    assert padded.cu_seqlens.tolist() == [0, 3, 5, 8, 16, 16, 16] and padded.max_seqlen == 8
    with pytest.raises(ConfigError, match="4 sequences.*pad_to=4"):
        attention.varlen_args(ROWS, pad_to=4)
    with pytest.raises(ConfigError, match="max_segments"):
        attention.varlen_slots(2, 0)


def test_position_ids_restart_per_document_and_padding_keeps_counting():
    pos = attention.flat_position_ids(ROWS)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], list(range(8))]
    # HF derives cu_seqlens from the zeros of the flattened position_ids: the same boundaries
    flat = pos.ravel()
    assert np.append(np.flatnonzero(flat == 0), flat.size).tolist() == \
        attention.varlen_args(ROWS).cu_seqlens.tolist()


def test_dense_mask_is_causal_within_documents_only():
    mask = attention.document_mask(ROWS)
    assert mask.shape == (2, 8, 8) and mask.dtype == bool
    assert mask[0, 4].tolist() == [False, False, False, True, True, False, False, False]
    assert mask[0, 7].tolist() == [False] * 5 + [True] * 3  # padding sees its document
    assert not mask[0, :6, 6:].any()  # no real token sees padding
    assert (mask[1] == np.tri(8, dtype=bool)).all()
    assert mask.diagonal(axis1=1, axis2=2).all()  # no empty softmax row


def test_segment_ids_must_be_a_batch():
    with pytest.raises(ConfigError, match="2-d integer"):
        attention.sequence_ids(np.zeros(4, dtype=np.int32))


# ---- the proof: a small causal transformer, fp64 --------------------------------------------------

VOCAB, DIM, HEADS, SEQ_LEN, MAX_SEGMENTS = 50, 16, 2, 24, 4


def packed_case(tmp_path, seed=0, docs=40, max_segments=MAX_SEGMENTS):
    """Random documents of 2 … seq_len + 1 tokens, packed; (tokens, pieces, batch, slots)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, SEQ_LEN + 2, size=docs)
    tokens = rng.integers(1, VOCAB, size=int(lengths.sum())).astype(np.int64)
    layout = pack.pack_documents(lengths, SEQ_LEN, max_segments)
    B = layout.num_rows
    out = {"inputs": np.empty((B, SEQ_LEN), np.int64), "targets": np.empty((B, SEQ_LEN), np.int64),
           "segment_ids": np.empty((B, SEQ_LEN), np.int32),
           "positions": np.empty((B, SEQ_LEN), np.int64), "loss_mask": np.empty((B, SEQ_LEN), np.uint8)}
    pack.fill_packed_rows(layout, np.arange(B), tokens, out)
    assert layout.num_truncated == 0 and layout.most_segments <= max_segments
    assert (np.diff(layout.row_ptr) > 1).sum() >= 3  # rows that really share documents
    return tokens, list(where_documents_are(layout)), out, attention.varlen_slots(B, max_segments)


def where_documents_are(layout):
    """(row, offset, global first token, length) of every segment: where each document lies."""
    for r in range(layout.num_rows):
        off = 0
        for s in range(layout.row_ptr[r], layout.row_ptr[r + 1]):
            yield r, off, int(layout.seg_start[s]), int(layout.seg_len[s])
            off += int(layout.seg_len[s])


CONCAT_CAP = SEQ_LEN // 2  # documents a concat row's inputs may cross (cu_seqlens slots)


def concat_case(tmp_path, seed=0, docs=160, batch_size=8):
    """Random documents of 1 … 11 tokens and a few longer than a row, in a store of small shards;
    the first batch of concat windows with document masks; (tokens, pieces, batch, slots), the
    pieces computed from the document lengths alone."""
    from tokenmill import Loader
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 12, size=docs)
    lengths[::40] = 2 * SEQ_LEN  # some windows lie inside one document
    tokens = rng.integers(1, VOCAB, size=int(lengths.sum())).astype(np.int64)
    write_token_store(tmp_path / "store", tokens, lengths, shard_tokens=100)
    with Loader(tmp_path / "store", seq_len=SEQ_LEN, batch_size=batch_size, document_masks=True,
                max_segments=CONCAT_CAP, dtype="int64", num_workers=0) as loader:
        batch = loader.batch_at(0)
        starts = loader.plan.resolve(np.arange(batch_size))[1].tolist()
    ends = np.cumsum(lengths).tolist()
    pieces = [(r, max(s, e - n) - s, max(s, e - n), min(s + SEQ_LEN + 1, e) - max(s, e - n))
              for r, s in enumerate(starts) for e, n in zip(ends, lengths.tolist())
              if e > s and e - n < s + SEQ_LEN + 1 and n > 0]
    assert [tokens[s:s + SEQ_LEN].tolist() for s in starts] == batch["inputs"].tolist()
    assert sum(r == 0 for r, *_ in pieces) > 2 and any(n > SEQ_LEN for *_, n in pieces)
    return tokens, pieces, batch, attention.varlen_slots(batch_size, CONCAT_CAP)


CASES = {"packed": packed_case, "concat": concat_case}


def params(seed=1, scale=0.5):
    rng = np.random.default_rng(seed)
    w = lambda *shape: rng.normal(0, scale, size=shape)
    p = {"tok": w(VOCAB, DIM), "pos": w(SEQ_LEN + 1, DIM), "out": w(DIM, VOCAB)}
    for i in range(2):
        p.update({f"qkv{i}": w(DIM, 3 * DIM), f"o{i}": w(DIM, DIM),
                  f"up{i}": w(DIM, 2 * DIM), f"down{i}": w(2 * DIM, DIM)})
    return p


def torch_losses(p, inputs, targets, positions, attend):
    """Per-token losses (B, L) of a 2-layer causal transformer; ``attend(q, k, v)`` on
    (B, heads, L, dim) is the only place the mask form enters."""
    import torch
    t = {k: torch.from_numpy(v) for k, v in p.items()}
    inputs, targets, positions = (torch.as_tensor(np.asarray(a, dtype=np.int64))
                                  for a in (inputs, targets, positions))
    B, L = inputs.shape
    x = t["tok"][inputs] + t["pos"][positions]
    for i in range(2):
        q, k, v = (h.reshape(B, L, HEADS, -1).transpose(1, 2)
                   for h in (x @ t[f"qkv{i}"]).chunk(3, dim=-1))
        x = x + attend(q, k, v).transpose(1, 2).reshape(B, L, DIM) @ t[f"o{i}"]
        x = x + torch.tanh(x @ t[f"up{i}"]) @ t[f"down{i}"]
    logits = x @ t["out"]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1),
                                             reduction="none").reshape(B, L).numpy()


def causal(q, k, v):
    import torch
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def sliced(cu_seqlens):
    """Attention by FlashAttention varlen's contract: the batch flattened to B·L tokens, causal
    attention within each [cu[i], cu[i+1]) (empty slots of a padded cu_seqlens do nothing)."""
    import torch
    cu = np.asarray(cu_seqlens).tolist()

    def attend(q, k, v):
        B, H, L, D = q.shape
        flat = [a.transpose(0, 1).reshape(H, B * L, D) for a in (q, k, v)]
        out = torch.zeros_like(flat[0])
        for s, e in zip(cu[:-1], cu[1:]):
            if e > s:
                out[:, s:e] = causal(*(a[None, :, s:e] for a in flat))[0]
        return out.reshape(H, B, L, D).transpose(0, 1)
    return attend


def alone(p, tokens, pieces, loss_fn=torch_losses, attend=causal):
    """Per-token losses of every piece (a document, or its part in a row) run by itself, from
    position 0 (batch of one)."""
    out = []
    for _, _, s, n in pieces:
        doc = tokens[s:s + n]
        out.append(loss_fn(p, doc[None, :-1], doc[None, 1:], np.arange(n - 1)[None],
                           attend)[0] if n > 1 else np.zeros(0))
    return out


def compare(batched, unpacked, pieces, loss_mask):
    """Largest |batched − alone| over every piece's tokens; checks the loss mask covers exactly
    them."""
    worst, covered = 0.0, 0
    for (r, off, _, n), want in zip(pieces, unpacked):
        assert loss_mask[r, off:off + n - 1].all()
        worst = max(worst, float(np.abs(batched[r, off:off + n - 1] - want).max(initial=0)))
        covered += n - 1
    assert covered == int(loss_mask.sum())
    return worst


def mask_forms(batch, slots):
    """Each kernel form of the batch's mask, as (name, positions, attend)."""
    import torch

    from tokenmill.torch import (
        dense_document_mask,
        document_mask,
        flat_position_ids,
        varlen_args,
    )
    seg = torch.from_numpy(batch["segment_ids"])
    dense = dense_document_mask(batch)
    cu, max_seqlen = varlen_args({"segment_ids": seg}, pad_to=slots)
    assert cu.dtype == torch.int32 and len(cu) == slots
    assert max_seqlen <= SEQ_LEN
    pos_ids = flat_position_ids({"segment_ids": seg}).numpy()
    hf_cu = np.append(np.flatnonzero(pos_ids.ravel() == 0), pos_ids.size)  # as HF derives them
    yield "dense", batch["positions"], lambda q, k, v: \
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    yield "cu_seqlens", batch["positions"], sliced(cu)
    yield "position_ids", pos_ids, sliced(hf_cu)
    from torch.nn.attention.flex_attention import flex_attention
    block_mask = document_mask(batch, block_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile": fine on CPU
        yield "flex", batch["positions"], lambda q, k, v: flex_attention(q, k, v,
                                                                          block_mask=block_mask)


@pytest.mark.parametrize("case", CASES)
def test_every_torch_mask_form_gives_each_document_its_own_losses(case, tmp_path):
    pytest.importorskip("torch")
    tokens, pieces, batch, slots = CASES[case](tmp_path)
    p = params()
    unpacked = alone(p, tokens, pieces)
    for name, positions, attend in mask_forms(batch, slots):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = torch_losses(p, batch["inputs"], batch["targets"], positions, attend)
        assert compare(got, unpacked, pieces, batch["loss_mask"]) <= 1e-9, name
    # the proof can fail: without the document mask, documents see each other
    dropped = torch_losses(p, batch["inputs"], batch["targets"], batch["positions"], causal)
    assert compare(dropped, unpacked, pieces, batch["loss_mask"]) > 1e-2


def jax_losses(p, inputs, targets, positions, mask):
    """The same transformer in jnp; attention is ``jax.nn.dot_product_attention(mask=…)``
    (mask None: plain causal)."""
    import jax
    import jax.numpy as jnp
    t = {k: jnp.asarray(v, jnp.float32) for k, v in p.items()}
    B, L = inputs.shape
    x = t["tok"][inputs] + t["pos"][positions]
    for i in range(2):
        q, k, v = (h.reshape(B, L, HEADS, -1) for h in jnp.split(x @ t[f"qkv{i}"], 3, axis=-1))
        a = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=mask is None)
        x = x + a.reshape(B, L, DIM) @ t[f"o{i}"]
        x = x + jnp.tanh(x @ t[f"up{i}"]) @ t[f"down{i}"]
    logp = jax.nn.log_softmax(x @ t["out"], axis=-1)
    return -np.asarray(jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], axis=-1)[..., 0])


def jax_alone(p, tokens, pieces):
    """``alone`` for jax_losses in one call of one shape: every piece a row of its own from
    position 0, padded at its end to SEQ_LEN + 1 tokens, which causal attention keeps its tokens
    from seeing (XLA compiles each op once per shape: a call per piece length took ~60 s)."""
    rows = np.zeros((len(pieces), SEQ_LEN + 1), np.int64)
    for i, (_, _, s, n) in enumerate(pieces):
        rows[i, :n] = tokens[s:s + n]
    positions = np.broadcast_to(np.arange(SEQ_LEN), (len(pieces), SEQ_LEN))
    losses = jax_losses(p, rows[:, :-1], rows[:, 1:], positions, None)  # None: is_causal=True
    return [losses[i, :n - 1] for i, (*_, n) in enumerate(pieces)]


@pytest.mark.parametrize("case", CASES)
def test_the_jax_mask_gives_each_document_its_own_losses(case, tmp_path):
    # float32: jax.nn.dot_product_attention's XLA path computes its logits in float32 even for
    # float64 inputs, so fp64 buys nothing; weights of scale 0.2 keep losses O(1) (max ≈ 6), and
    # 1e-5 is ~10 float32 ulps of them, while dropping the mask moves losses by ~0.7
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from tokenmill.jax import document_mask, sequence_ids
    tokens, pieces, batch, _ = CASES[case](tmp_path, seed=2)
    p = params(seed=3, scale=0.2)
    seg = jnp.asarray(batch["segment_ids"])
    assert (np.asarray(sequence_ids({"segment_ids": seg})) ==
            attention.sequence_ids(batch["segment_ids"])).all()  # one rule, on host and device
    mask = document_mask({"segment_ids": seg})
    assert mask.shape == (len(batch["inputs"]), 1, SEQ_LEN, SEQ_LEN)
    unpacked = jax_alone(p, tokens, pieces)
    for name, m in (("mask", mask), ("jit", jax.jit(document_mask)(seg))):
        got = jax_losses(p, batch["inputs"], batch["targets"], batch["positions"], m)
        assert compare(got, unpacked, pieces, batch["loss_mask"]) <= 1e-5, name
    plain = jnp.tril(jnp.ones((SEQ_LEN, SEQ_LEN), bool))
    dropped = jax_losses(p, batch["inputs"], batch["targets"], batch["positions"], plain)
    assert compare(dropped, unpacked, pieces, batch["loss_mask"]) > 1e-2


# ---- the cap on documents per row, on a real store ------------------------------------------------

@pytest.fixture(scope="module")
def paragraph_store(tmp_path_factory):
    """A store of real text: paragraphs of the stdlib's sources, bytes tokenizer."""
    from tokenmill import prepare
    tmp = tmp_path_factory.mktemp("paragraphs")
    texts = [para for t in stdlib_texts(300_000) for para in t.split("\n\n") if para.strip()]
    write_jsonl(tmp / "p.jsonl", texts)
    prepare(str(tmp / "p.jsonl"), out=tmp / "store", tokenizer="bytes", workers=1, progress=False)
    return tmp / "store"


@pytest.mark.parametrize("cap", [1, 2, 8])
def test_max_segments_caps_every_row_and_reports_its_padding(paragraph_store, tmp_path, cap):
    from tokenmill import Loader
    from tokenmill.load.packplan import epoch_layout
    kw = dict(seq_len=512, batch_size=4, layout="packed", num_workers=0)
    with Loader(paragraph_store, **kw) as free, Loader(paragraph_store, max_segments=cap, **kw) as capped:
        layout = epoch_layout(capped.plan.sources[0].packed, 0)
        free_layout = epoch_layout(free.plan.sources[0].packed, 0)
        assert np.diff(layout.row_ptr).max() <= cap  # every row of the epoch
        for batch in capped.batch_at(0), capped.batch_at(capped.samples_per_epoch - 4):
            assert batch["segment_ids"].max(axis=1).max() <= cap
        stats, base = capped.layout_stats, free.layout_stats
        assert stats["max_segments"] == cap and stats["most_segments"] <= cap
        assert base["max_segments"] is None and base["most_segments"] > 8  # the cap binds
        used = int(layout.seg_len.sum())
        assert stats["padding_at_most"] >= 1 - used / (layout.num_rows * 513) - 1e-12
        assert layout.num_truncated == free_layout.num_truncated  # the cap cuts no document
        assert layout.padding_fraction > free_layout.padding_fraction  # what the cap costs
        if cap == 1:
            assert layout.num_rows == len(layout.seg_len)  # one segment a row
        assert capped.fingerprint != free.fingerprint  # the cap changes the stream
        # the same pairs are packed, whatever the cap: every (input, target) pair once
        assert sorted(pairs_of(layout)) == sorted(pairs_of(free_layout))
    assert list(tmp_path.iterdir()) == []  # nothing written anywhere


def pairs_of(layout) -> list[int]:
    """The global token each (input, target) pair of the layout starts at."""
    return np.concatenate([np.arange(s, s + n - 1) for s, n in
                           zip(layout.seg_start.tolist(), layout.seg_len.tolist())]).tolist()


def test_max_segments_is_checked():
    with pytest.raises(ConfigError, match="max_segments"):
        pack.pack_documents(np.array([3, 2]), 4, max_segments=0)
    from tokenmill.load.plan import LayoutConfig
    with pytest.raises(ConfigError, match="layout='packed'"):
        LayoutConfig(seq_len=8, layout="concat", max_segments=2)


def test_inspect_reports_the_packing_and_its_cap(paragraph_store, capsys):
    import json

    from tokenmill.cli import main
    from tokenmill.load.packplan import PackedPlan, epoch_layout
    assert main(["inspect", str(paragraph_store), "--seq-len", "512", "--max-segments", "2"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    from tokenmill import TokenStore
    with TokenStore(paragraph_store) as store:
        plan = PackedPlan(store, seq_len=512, max_segments=2, seed=0, salt=0)
        layout = epoch_layout(plan, 0)
        cut = sum(plan.window_rows(0, w).num_cut for w in range(plan.num_windows()))
        docs = len(np.unique(layout.seg_doc))
    assert line == (f"packed       seq_len 512, max_segments 2 (strata-v2): {layout.num_rows:,} "
                    f"rows, padding {100 * layout.padding_fraction:.2f}%, {layout.num_truncated:,} "
                    f"documents longer than a row, {cut:,} of {docs:,} more cut across rows, at "
                    "most 2 a row")
    assert main(["inspect", str(paragraph_store), "--json", "--seq-len", "512"]) == 0
    packing = json.loads(capsys.readouterr().out)["packing"]
    assert packing["max_segments"] is None and packing["most_segments"] > 2
    assert packing["padding_fraction"] < layout.padding_fraction


def test_a_capped_loader_keeps_its_cap_in_a_token_dataset(paragraph_store, tmp_path):
    pytest.importorskip("torch")
    from tokenmill import Loader
    from tokenmill.torch import TokenDataset
    loader = Loader(paragraph_store, seq_len=512, batch_size=4, layout="packed", max_segments=2,
                    num_workers=0)
    with loader:
        want = loader.batch_at(0)["segment_ids"].copy()
        got = next(iter(TokenDataset(loader)))["segment_ids"].numpy()
    assert (got == want).all() and got.max() <= 2


def test_the_cap_closes_a_row_with_room_left():
    free = pack.pack_documents(np.full(10, 2), seq_len=9)
    capped = pack.pack_documents(np.full(10, 2), seq_len=9, max_segments=3)
    assert free.row_ptr.tolist() == [0, 5, 10]  # 5 × 2 tokens fill a row of 10
    assert capped.row_ptr.tolist() == [0, 3, 6, 9, 10]
    assert capped.padding_fraction == pytest.approx(1 - 20 / 40)


@pytest.mark.parametrize("cap", [1, 2, 3, 8])
def test_a_capped_layout_places_every_piece_once_within_its_row(cap):
    rng = np.random.default_rng(cap)
    lengths = np.concatenate([rng.integers(1, 12, size=300), rng.integers(30, 90, size=20)])
    free, capped = pack.pack_documents(lengths, 31), pack.pack_documents(lengths, 31, cap)
    assert sorted(zip(capped.seg_start.tolist(), capped.seg_len.tolist())) == \
        sorted(zip(free.seg_start.tolist(), free.seg_len.tolist()))  # the same pieces, each once
    per_row = np.diff(capped.row_ptr)
    assert per_row.min() >= 1 and per_row.max() <= cap
    tokens = np.add.reduceat(capped.seg_len, capped.row_ptr[:-1])
    assert tokens.max() <= 32
    # no fewer rows than tokens or slots force
    assert capped.num_rows >= max(-(-int(lengths.sum()) // 32), -(-len(capped.seg_len) // cap))
