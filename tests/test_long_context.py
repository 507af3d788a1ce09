"""Long context (issue 25): a corpus of ~1M-token documents read at seq_len 8k, 128k and 1M, packed
and concat. ``stats()["cuts"]`` — the documents the rows handed out cut, read from the layout —
equals a count made from the batches' own tokens (a positional store: token = its place in the
stream, so each input names its document). Counts only: memory is benchmarks/long_context.py's."""

import json

import numpy as np
import pytest
from conftest import take, write_positional_store

from tokenmill import Loader
from tokenmill.load.cuts import count_cuts

LENGTHS = [1_048_577, 1_048_578, 999_999, 1_300_000, 2_100_000, 131_073, 131_074, 8_193, 8_194,
           5_000, 3, 1, 2, 700_001]  # around a row of 1M, 128k and 8k, and short ones
TOKENS_A_BATCH = 1 << 20


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_positional_store(tmp_path_factory.mktemp("long") / "s", LENGTHS,
                                  shard_tokens=3_000_000)


def parts_of(batch: dict, ends: np.ndarray) -> list[tuple[int, int, int]]:
    """(first token, last input token, inputs) of every run of one document in each row's
    inputs, from the tokens alone (padding, segment id 0, left out); a part is whole when it
    holds its document's first and last token (the last may be the row's final target)."""
    out = []
    seg = batch.get("segment_ids")
    for r, row in enumerate(batch["inputs"].astype(np.int64)):
        doc = np.searchsorted(ends, row, side="right")
        cut = np.flatnonzero((np.diff(row) != 1) | (np.diff(doc) != 0) |
                             (np.diff(seg[r]) != 0 if seg is not None else False)) + 1
        for a, b in zip([0, *cut.tolist()], [*cut.tolist(), len(row)]):
            if seg is None or seg[r, a] != 0:
                last = int(row[b - 1])
                if b == len(row) and batch["targets"][r, -1] == last + 1 and \
                        np.searchsorted(ends, last + 1, side="right") == doc[a]:
                    last += 1  # the row's final target: the part's last token
                out.append((int(row[a]), last, b - a))
    return out


def counted(batches: list[dict]) -> dict[str, int]:
    """rows, pieces, documents (cut, at their first token), tokens (inputs of pieces)."""
    ends = np.cumsum(LENGTHS)
    starts = ends - LENGTHS
    got = {"rows": 0, "pieces": 0, "documents": 0, "tokens": 0}
    for batch in batches:
        got["rows"] += len(batch["inputs"])
        for first, last, n in parts_of(batch, ends):
            d = np.searchsorted(ends, first, side="right")
            if first != starts[d] or last != ends[d] - 1:
                got["pieces"] += 1
                got["documents"] += first == starts[d]
                got["tokens"] += n
    return got


@pytest.mark.parametrize("seq_len", [8192, 131072, 1 << 20])
@pytest.mark.parametrize("layout", [{"layout": "packed"}, {"layout": "concat"},
                                    {"layout": "concat", "document_masks": True}])
def test_cut_documents_and_tokens_equal_a_count_from_the_batches(store, seq_len, layout):
    with Loader(store, seq_len=seq_len, batch_size=TOKENS_A_BATCH // seq_len, seed=4,
                num_workers=0, **layout) as ld:
        batches = take(ld, len(ld))  # an epoch's steps
        cuts = ld.stats()["cuts"]
        # every window of epoch 0 (the steps' positions are 0, 1, 2, …: rows in order)
        rows = np.concatenate([b["inputs"] for b in batches + take(ld, 1)])
        held = np.zeros(sum(LENGTHS), bool)
        for r in rows[:ld.samples_per_epoch]:
            held[r] = held[r[-1] + 1] = True  # the inputs, and the last target
    want = counted(batches)
    left = cuts.pop("epoch_tokens_left_out")
    assert cuts == {"since_sample": 0, **want}
    assert want["pieces"] > 0 and want["documents"] > 0
    # an epoch's windows hold all but what is left out (packed: everything)
    assert left == (len(held) - held.sum() if layout["layout"] == "concat" else 0)
    assert left > 0 or layout["layout"] == "packed"
    if layout["layout"] == "packed" and seq_len == 1 << 20:
        # every document longer than a row is cut, once; nothing else at this length
        assert want["documents"] == sum(n > seq_len + 1 for n in LENGTHS)


def test_cut_counts_are_the_steps_handed_out_whatever_ran_ahead_and_after_a_resume(store):
    seq_len, per = 131072, 4

    def cuts(loader):
        got = loader.stats()["cuts"]
        assert got.pop("epoch_tokens_left_out") == 0  # packed
        return got

    def loader(**kw):
        return Loader(store, seq_len=seq_len, batch_size=per, layout="packed", seed=4, **kw)

    with loader(num_workers=0) as ref:
        batches = take(ref, 6)
    with loader(num_workers=2, prefetch=4) as ahead:  # six steps handed out, more computed
        take(ahead, 3)
        assert cuts(ahead) == {"since_sample": 0, **counted(batches[:3])}
        take(ahead, 3)
        assert cuts(ahead) == {"since_sample": 0, **counted(batches)}
        state = json.loads(json.dumps(ahead.state_dict()))
    with loader(num_workers=0) as again:  # a run resumed at step 2 counts from there
        again.load_state_dict({**state, "consumed_samples": 2 * per})
        assert cuts(again) == {"since_sample": 2 * per, **counted([])}
        take(again, 4)
        assert cuts(again) == {"since_sample": 2 * per, **counted(batches[2:])}


def test_count_cuts_reads_no_tokens_and_counts_rows_of_two_ranks_apart(store):
    """The count of a global batch is the sum of its ranks' counts (each rank its own rows)."""
    with Loader(store, seq_len=8192, batch_size=16, layout="packed", seed=4, num_workers=0) as ld:
        whole = count_cuts(ld.plan, np.arange(32, 48))
        halves = [count_cuts(ld.plan, np.arange(32, 40)), count_cuts(ld.plan, np.arange(40, 48))]
        assert whole == {k: halves[0][k] + halves[1][k] for k in whole}
        assert whole == counted([ld.batch_at(32)])


@pytest.mark.parametrize("seq_len", [131072, 1 << 20])
def test_the_first_batch_packs_the_windows_of_its_own_epoch_not_thousands_of_rows_ahead(store,
                                                                                        seq_len):
    """An epoch of long rows is a few dozen rows: the plan resolves positions a block at a time,
    and a block of 4,096 positions spanned ~70 epochs at 128k (~500 at 1M), each one's window
    packed for the first batch. Now at most the batch's window and the one packed ahead."""
    with Loader(store, seq_len=seq_len, batch_size=1, layout="packed", seed=4,
                num_workers=0) as ld:
        next(iter(ld))
        assert ld.layout_stats["windows_packed"] <= 2
