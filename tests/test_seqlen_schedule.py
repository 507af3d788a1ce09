"""Loader(seq_len_schedule=…, tokens_per_step=…) (issue 25): batch k has its phase's seq_len and
rows; an epoch reads every (document, token range) of the corpus once across phases; resume is
exact before, at and after each phase boundary and on another world size; misuse is refused in
one line. Real Loaders on a positional store (token = its global position), exact equalities."""

import json

import numpy as np
import pytest
import xxhash

from conftest import assert_resumes_exactly, lengths_summing_to, same, take, \
    write_positional_store
from tokenmill import Loader, Meter
from tokenmill.base.errors import ConfigError
from tokenmill.load.seqlens import LengthSchedule

PHASES = [(0, 8), (3, 16), (6, 32)]
T = 192  # tokens a step: 24 rows of 8, 12 of 16, 6 of 32 — 1, 2 or 3 ranks share each
C = 32  # the chunk steps are cut from: the seq_lens' least common multiple
CHUNKS = 60  # an epoch: 60 chunks of 32 tokens = 10 steps
SHAPES = [8] * 3 + [16] * 3 + [32] * 6  # seq_len of steps 0 … 11
BOUNDARIES = (2, 3, 4, 5, 6, 7)  # each phase boundary −1, 0, +1
# 1,969 tokens (exactly 60 chunks of 32 an epoch, whatever its offset) in 70 documents of 1 … 49
# tokens, the last stretched; where each starts, from the lengths written (not read back)
LENGTHS = lengths_summing_to(C * (CHUNKS + 1) + 17, docs=70, longest=50, seed=25)
DOC_STARTS = np.concatenate([[0], np.cumsum(LENGTHS)])


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The positional store of LENGTHS, over shards of ~500 tokens."""
    return write_positional_store(tmp_path_factory.mktemp("sched") / "s", LENGTHS,
                                  shard_tokens=500)


def scheduled(store, **kw) -> Loader:
    return Loader(store, **{"seq_len_schedule": PHASES, "tokens_per_step": T,
                            "num_workers": 0, **kw})


def starts_of(batch) -> list[int]:
    """Each row's first token, after checking the row is a window of the positional stream."""
    x = batch["inputs"].astype(np.int64)
    L = x.shape[1]
    assert (x == x[:, :1] + np.arange(L)).all() and (batch["targets"] == x + 1).all()
    return x[:, 0].tolist()


def pieces(rows: list[tuple[int, int]], doc_starts: np.ndarray) -> list[tuple[int, int, int]]:
    """(document, first token, end) of every document piece of rows (first token, length),
    merged where one piece ends where the next of its document starts; overlaps fail."""
    out = []
    for s, n in rows:
        first, last = np.searchsorted(doc_starts, [s, s + n - 1], side="right") - 1
        out += [(d, max(s, int(doc_starts[d])), min(s + n, int(doc_starts[d + 1])))
                for d in range(int(first), int(last) + 1)]
    merged = []
    for d, lo, hi in sorted(out):
        if merged and merged[-1][0] == d and merged[-1][2] >= lo:
            assert merged[-1][2] == lo, f"document {d}: tokens from {lo} read twice"
            merged[-1] = (d, merged[-1][1], hi)
        else:
            merged.append((d, lo, hi))
    return merged


def digest(ps) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(ps).encode())


def global_batches(store, steps: int) -> list[dict]:
    with scheduled(store) as ld:
        return take(ld, steps)


# ---- what a step holds ------------------------------------------------------------------------

def test_batch_k_has_its_phases_seq_len_and_rows_on_every_rank(store):
    ranks = [scheduled(store, rank=r, world_size=2) for r in range(2)]
    got = [take(ld, 12) for ld in ranks]
    assert [b["inputs"].shape for b in got[1]] == [(T // L // 2, L) for L in SHAPES]
    ref = global_batches(store, 12)
    for k in range(12):  # rank r holds rows [r·B, (r+1)·B) of the global batch, as before
        assert np.array_equal(np.concatenate([g[k]["inputs"] for g in got]), ref[k]["inputs"])
        starts_of(ref[k])
    assert ranks[0].consumed_samples == 3 * 24 + 3 * 12 + 6 * 6
    assert len(ranks[0]) == CHUNKS * C // T == 10 and ranks[0].global_batch_size is None


def test_an_epoch_reads_every_document_token_range_once_across_three_phases(store):
    """The done-when: the hash of (document, token range) over an epoch of three phases equals
    the corpus's — the documents clipped to the epoch's chunks — and a one-seq_len run's."""
    doc_starts = DOC_STARTS
    ranks = [scheduled(store, rank=r, world_size=2, epochs=2) for r in range(2)]
    steps = [take(ld, None) for ld in ranks]
    assert [len(x) for x in steps] == [20, 20]  # epochs=2: 2 × 10 steps, then the end
    plain = Loader(store, seq_len=C, batch_size=6, num_workers=0, epochs=2)
    for e in range(2):
        rows = [(s, b["inputs"].shape[1]) for batches in steps
                for b in batches[10 * e:10 * e + 10] for s in starts_of(b)]
        assert sum(n for _, n in rows) == CHUNKS * C
        read = pieces(rows, doc_starts)
        lo, hi = read[0][1], read[-1][2]
        assert hi - lo == CHUNKS * C  # one run of tokens, every one read once
        corpus = [(d, max(lo, int(a)), min(hi, int(b))) for d, (a, b) in
                  enumerate(zip(doc_starts[:-1], doc_starts[1:])) if a < hi and b > lo]
        one_len = pieces([(s, C) for b in take(plain, 10) for s in starts_of(b)], doc_starts)
        assert digest(read) == digest(corpus) == digest(one_len)
        assert read == corpus


def test_workers_and_prefetch_across_phase_boundaries_change_no_batch(store):
    ref = global_batches(store, 12)
    for kw in ({"num_workers": 2, "prefetch": 4}, {"num_workers": "auto"}):
        with scheduled(store, **kw) as ld:
            held = list(b for _, b in zip(range(12), ld))  # kept, never copied
            assert same([{k: np.array(v) for k, v in b.items()} for b in held], ref), kw
        assert same(held, ref), "a held batch was overwritten by a later phase's"


def test_document_masks_follow_the_documents_at_every_phase(store):
    doc_starts = DOC_STARTS
    with scheduled(store, document_masks=True) as ld:
        for L, b in zip(SHAPES, take(ld, 8)):
            assert b["segment_ids"].shape == (T // L, L)
            p = b["inputs"].astype(np.int64)
            doc = np.searchsorted(doc_starts, p, side="right") - 1
            seg_start = np.maximum(doc_starts[doc], p[:, :1])
            assert (b["positions"] == p - seg_start).all()
            assert (b["segment_ids"] == 1 + doc - doc[:, :1]).all()
            assert (b["loss_mask"] == (p + 1 != doc_starts[doc + 1])).all()


def test_golden_first_rows_of_seed_0(store):
    """Only update if you mean to break users' reproducibility."""
    with scheduled(store) as ld:
        got = [starts_of(b)[:4] for b in take(ld, 8)]
    assert got == GOLDEN


GOLDEN = [  # steps 0 … 7: four rows of 8, of 16 (two from each chunk of 32), then of 32
    [547, 555, 563, 571], [739, 747, 755, 763], [963, 971, 979, 987],
    [835, 851, 1891, 1907], [1635, 1651, 1443, 1459], [1411, 1427, 227, 243],
    [867, 611, 483, 515], [675, 1507, 195, 1731]]


# ---- resume -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [{}, {"num_workers": 1, "prefetch": 3}], ids=["inline", "ahead"])
def test_resume_is_exact_at_every_step_across_both_boundaries(store, kw):
    assert_resumes_exactly(lambda: scheduled(store, rank=1, world_size=2, **kw), 9)


@pytest.mark.parametrize("k", BOUNDARIES)
def test_resume_on_three_ranks_from_two_at_each_boundary(store, k):
    ref = global_batches(store, 10)
    two = [scheduled(store, rank=r, world_size=2) for r in range(2)]
    before = [take(ld, k) for ld in two]
    for j in range(k):
        assert np.array_equal(np.concatenate([x[j]["inputs"] for x in before]), ref[j]["inputs"])
    state = json.loads(json.dumps(two[0].state_dict()))
    assert state == json.loads(json.dumps(two[1].state_dict()))
    three = [scheduled(store, rank=r, world_size=3) for r in range(3)]
    for ld in three:
        ld.load_state_dict(state)
    after = [take(ld, 10 - k) for ld in three]
    for j in range(10 - k):
        for key in ("inputs", "targets"):
            assert np.array_equal(np.concatenate([x[j][key] for x in after]), ref[k + j][key])
    assert three[2].consumed_samples == sum(T // L for L in SHAPES[:10])


def test_a_state_without_the_schedule_and_one_with_it_refuse_each_other(store):
    sched_txt = r"\[\[0, 8\], \[3, 16\], \[6, 32\]\] at 192 tokens a step"
    with Loader(store, seq_len=16, batch_size=12, num_workers=0) as plain:
        take(plain, 2)
        plain_state = json.loads(json.dumps(plain.state_dict()))
    with scheduled(store) as ld:
        take(ld, 2)
        state = json.loads(json.dumps(ld.state_dict()))
        with pytest.raises(ConfigError, match=rf"seq_len_schedule off \(seq_len 16\) → {sched_txt}"
                           r" \(resume with the run's seq_len_schedule"):
            ld.load_state_dict(plain_state)
    with Loader(store, seq_len=16, batch_size=12, num_workers=0) as plain:
        with pytest.raises(ConfigError, match=rf"schedule {sched_txt} → off \(seq_len 16\)"):
            plain.load_state_dict(state)
        with pytest.raises(ConfigError, match="fingerprint"):  # the three-key form: by fingerprint
            plain.load_state_dict({k: state[k] for k in ("version", "consumed_samples",
                                                         "fingerprint")})
    for other in ({"seq_len_schedule": [(0, 8), (4, 16), (6, 32)]}, {"tokens_per_step": 2 * T}):
        with scheduled(store, **other) as ld, pytest.raises(ConfigError, match=rf"{sched_txt} → "):
            ld.load_state_dict(state)
    with scheduled(store) as ld:
        with pytest.raises(ConfigError, match="25 samples falls inside step 1 .phase 0, 24 rows"):
            ld.load_state_dict({**state, "consumed_samples": 25})
        ld.load_state_dict(state)
        assert ld.consumed_samples == 48


# ---- misuse -----------------------------------------------------------------------------------

MISUSE = {  # Loader settings → what the one-line ConfigError says
    "starts that do not rise": ({"seq_len_schedule": [(0, 8), (5, 16), (5, 32)]},
                                r"begin at step 0 and rise \(got \[0, 5, 5\]\): list"),
    "a first phase after step 0": ({"seq_len_schedule": [(2, 8)]}, r"\(got \[2\]\)"),
    "seq_len not dividing tokens_per_step": ({"seq_len_schedule": [(0, 8), (3, 40)]},
                                             "seq_len=40, which does not divide tokens_per_step"
                                             "=192; make tokens_per_step a multiple"),
    "not pairs": ({"seq_len_schedule": "8"}, "must be .start step, seq_len. pairs"),
    "a float seq_len": ({"seq_len_schedule": [(0, 8.0)]}, "int pairs"),
    "no tokens_per_step": ({"tokens_per_step": None}, "go together .got seq_len_schedule="),
    "seq_len too": ({"seq_len": 16}, r"drop seq_len=16 and batch_size=None"),
    "batch_size too": ({"batch_size": 4}, r"drop seq_len=None and batch_size=4"),
    "rows ranks cannot share": ({"world_size": 5}, "the phase at step 0 .seq_len=8. has 24 rows a "
                                "step, which world_size=5 ranks cannot share equally; make "
                                "tokens_per_step=192 a multiple of world_size × 32"),
    "a step over an epoch": ({"tokens_per_step": 2048}, "tokens_per_step=2,048 is more than one "
                             "epoch holds .1,920 tokens in chunks of 32."),
    "packed": ({"layout": "packed"}, "does not take layout='packed': packed rows"),
    "balance": ({"document_masks": True, "balance": "attention"}, "balance='attention'"),
    "process workers": ({"worker_type": "process", "num_workers": 1}, "worker_type='process'"),
}


@pytest.mark.parametrize("case", MISUSE)
def test_misuse_is_refused_in_one_line(store, case):
    kw, msg = MISUSE[case]
    with pytest.raises(ConfigError, match=msg) as e:
        scheduled(store, **kw).close()
    assert "\n" not in str(e.value)


def test_a_mixture_or_no_seq_len_at_all_is_refused(store):
    with pytest.raises(ConfigError, match="a mixture of stores: the schedule cuts one store's"):
        Loader({store: 1.0}, seq_len_schedule=PHASES, tokens_per_step=T)
    with pytest.raises(ConfigError, match=r"Loader needs seq_len and batch_size \(got seq_len="
                       r"None, batch_size=8\), or seq_len_schedule="):
        Loader(store, batch_size=8)
    with scheduled(store) as ld, pytest.raises(ConfigError, match="Loader.explain needs one"):
        ld.explain(0)


# ---- what it reports --------------------------------------------------------------------------

def test_stats_and_the_meter_show_the_current_phase(store):
    with scheduled(store, rank=0, world_size=2) as ld:
        assert ld.stats()["seq_len_phase"]["step"] == 0  # nothing handed out: the first step
        seen = []
        for k, _ in zip(range(7), ld):
            p = ld.stats()["seq_len_phase"]
            seen.append((p["step"], p["phase"], p["seq_len"], p["rows"], p["rows_per_rank"]))
        assert seen == [(k, min(k // 3, 2), SHAPES[k], T // SHAPES[k], T // SHAPES[k] // 2)
                        for k in range(7)]
        assert p["phases"] == 3 and p["next_phase_at"] is None and p["tokens_per_step"] == T
        assert ld.describe()["seq_len_schedule"] == {
            "phases": [list(x) for x in PHASES], "tokens_per_step": T}
    with scheduled(store) as ld:
        meter = Meter(ld, log=lambda line: None)
        for _ in zip(range(4), meter):
            pass
        assert "| seq_len 16 (phase 2 of 3)" in meter.report()


def test_schedule_locates_every_row_and_cuts_at_its_chunk():
    sched = LengthSchedule(PHASES, tokens_per_step=T)
    assert sched.chunk_tokens == 32
    assert LengthSchedule(((0, 3000), (5, 4096)), tokens_per_step=3000 * 4096).chunk_tokens == \
        3000 * 4096 // 8
    row = 0
    for step in range(12):
        for j in range(T // SHAPES[step]):
            assert sched.locate(row) == (step, j)
            row += 1
