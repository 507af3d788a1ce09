"""PyTorch integration: tensors on a device, the pinned-copy pipeline (through a fake device),
DataLoader/StatefulDataLoader workers, exact resume, and two real gloo ranks."""

import contextlib
import json
import pickle

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from conftest import lengths_summing_to, run_guide, same, take, write_positional_store
from tokenmill.base.errors import ConfigError, StaleIterator, StoreError
from tokenmill.integrations.torch import TokenDataset, TorchBatches, to_torch
from tokenmill.load.loader import Loader

L = 8


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Token = global position; 96·L + L tokens: 96 concat samples an epoch, over 3 shards."""
    lengths = lengths_summing_to(97 * L, docs=30, longest=40, seed=5)
    return write_positional_store(tmp_path_factory.mktemp("t") / "store", lengths, shard_tokens=300)


def expected(loader, steps, start=0):
    """The loader's own batches for steps [start, start + steps), as numpy."""
    gb = loader.global_batch_size
    return [loader.batch_at(start + k * gb) for k in range(steps)]


# ---- a fake device: copies run late, so every missing wait or synchronize shows -------------

class FakeEvent:
    def __init__(self, upto):
        self.upto = upto  # it completes with copies[:upto], the ones issued before it


class FakeDevice:
    """``_Device`` on CPU whose side-stream copies run only when the host synchronizes on an
    event (or at ``drain``), reading the pinned buffer at *that* moment: a buffer refilled before
    its copy finished yields wrong data, and a tensor handed out before the compute stream was
    told to wait for it is caught by ``visible``."""

    def __init__(self):
        self.copies = []  # (host, device tensor), in issue order
        self.done = 0  # copies that have run
        self.visible = 0  # copies the compute stream has waited for
        self.kept = set()
        self.in_stream = False
        self.pinned_count = 0

    def pinned(self, like):
        self.pinned_count += 1
        return torch.empty_like(like)

    @contextlib.contextmanager
    def stream(self):
        self.in_stream = True
        yield
        self.in_stream = False

    def copy(self, host):
        assert self.in_stream, "a copy issued outside the side stream"
        dst = torch.full_like(host, -1)
        self.copies.append((host, dst))
        return dst

    def record(self):
        return FakeEvent(len(self.copies))

    def wait(self, event):
        self.visible = max(self.visible, event.upto)

    def synchronize(self, event):
        self._run(event.upto)

    def keep(self, tensor):
        self.kept.add(id(tensor))

    def drain(self):
        self._run(len(self.copies))

    def _run(self, upto):
        for host, dst in self.copies[self.done:upto]:
            dst.copy_(host)
        self.done = max(self.done, upto)

    def index(self, tensor):
        return next(i for i, (_, d) in enumerate(self.copies) if d is tensor)


def test_cpu_batches_equal_the_loader_and_share_its_memory(store):
    with to_torch(Loader(store, seq_len=L, batch_size=4, seed=3, epochs=1, num_workers=2)) as batches:
        held = list(batches)  # tensors kept, not copied: the loader must not reuse their memory
        for b in held:
            assert b["inputs"].dtype == torch.int32 and b["inputs"].device.type == "cpu"
            assert not b["inputs"].untyped_storage().resizable()  # from_numpy: numpy owns it
        assert len(held) == len(batches) == 96 // 4
        assert same(held, expected(batches.loader, len(held)))


def test_cpu_tensors_share_the_loaders_buffers_and_are_never_overwritten_while_held(store):
    loader = Loader(store, seq_len=L, batch_size=4, seed=3, epochs=1, num_workers=0)
    want = expected(loader, 24)
    with to_torch(loader) as batches:
        it = iter(batches)
        seen, kept = set(), []
        for k in range(24):
            b = next(it)
            seen.add(b["inputs"].data_ptr())  # the loader's few buffers come back: no copy
            assert np.array_equal(b["inputs"].numpy(), want[k]["inputs"])
            if k % 5 == 0:
                kept.append((k, b))  # held: its buffer must not be refilled
        assert len(seen) <= 4 + len(kept), len(seen)
        for k, b in kept:
            assert np.array_equal(b["inputs"].numpy(), want[k]["inputs"]), f"batch {k} overwritten"


@pytest.mark.parametrize("alias", ["detach", "numpy", "view_as"])
def test_a_cpu_batch_held_through_an_alias_of_its_tensor_is_never_overwritten(store, alias):
    # t.detach() and t.numpy() share t's memory without referencing the tensor object the
    # loader handed out: holding only them must keep the buffer, as holding t does
    loader = Loader(store, seq_len=L, batch_size=4, seed=3, num_workers=0)
    want = expected(loader, 20)
    take_alias = {"detach": lambda t: t.detach(), "numpy": lambda t: t.numpy(),
                  "view_as": lambda t: t.view_as(t)}[alias]
    with to_torch(loader) as batches:
        it = iter(batches)
        kept = [(k, take_alias(next(it)["inputs"])) for k in range(3)]
        for k in range(3, 20):
            assert np.array_equal(next(it)["inputs"].numpy(), want[k]["inputs"])
        for k, a in kept:
            a = a.numpy() if isinstance(a, torch.Tensor) else a
            assert np.array_equal(a, want[k]["inputs"]), f"batch {k} overwritten"


def test_the_loader_itself_hands_out_arrays_again_after_a_to_torch_pass(store):
    # to_torch's views belong to its pass: the loader iterated itself gives numpy arrays, a
    # tensor still held from the torch pass is never overwritten, and the stream goes on
    loader = Loader(store, seq_len=L, batch_size=4, seed=3, num_workers=0)
    want = expected(loader, 12)
    it = iter(to_torch(loader))
    kept = [next(it) for _ in range(3)]
    plain = iter(loader)
    for k in range(3, 9):
        b = next(plain)
        assert type(b["inputs"]) is np.ndarray and np.array_equal(b["inputs"], want[k]["inputs"])
    back = iter(to_torch(loader))
    for k in range(9, 12):
        b = next(back)
        assert isinstance(b["inputs"], torch.Tensor)
        assert np.array_equal(b["inputs"].numpy(), want[k]["inputs"])
    for k, b in enumerate(kept):
        assert np.array_equal(b["inputs"].numpy(), want[k]["inputs"]), f"batch {k} overwritten"
    loader.close()


def test_a_watched_trace_shows_device_copies_inside_the_data_waits(store, tmp_path):
    from tokenmill.observe.watch import Watch
    loader = Loader(store, seq_len=L, batch_size=4, num_workers=0)
    batches = TorchBatches(loader, torch.device("cpu"), ops=FakeDevice(), depth=2)
    with Watch(batches, every=5, trace=tmp_path / "t{rank}.json", log=None) as w:
        for _ in zip(range(12), w):
            pass
    events = [e for e in json.loads((tmp_path / "t0.json").read_text())["traceEvents"]
              if e["ph"] == "X"]
    waits = [e for e in events if e["name"] == "data wait"]
    for name in ("device copy", "plan", "gather"):
        mine = [e for e in events if e["name"] == name]
        assert len(mine) >= 12 and all(
            any(w["ts"] <= e["ts"] and e["ts"] + e["dur"] <= w["ts"] + w["dur"] + 1e-3
                for w in waits) for e in mine), name
    batches.close()


def test_pipeline_delivers_exact_batches_overlapped_waited_and_kept(store):
    fake = FakeDevice()
    loader = Loader(store, seq_len=L, batch_size=4, layout="packed", seed=1, num_workers=2)
    held, n_keys = [], 5  # inputs, targets, segment_ids, positions, loss_mask
    with TorchBatches(loader, torch.device("cpu"), ops=fake, depth=2) as batches:
        for k, b in zip(range(30), batches):
            assert len(fake.copies) >= (k + 2) * n_keys  # batch k+1 was sent before k is used
            for t in b.values():
                assert fake.index(t) < fake.visible, "handed out before the compute stream waited"
                assert id(t) in fake.kept, "handed out without record_stream"
            held.append(b)
        assert fake.pinned_count == 3 * n_keys  # depth + 1 pinned slots, reused
        fake.drain()
        assert same(held, expected(loader, 30))


def test_a_seq_len_schedule_reaches_the_device_in_each_phases_shape(store):
    """Loader(seq_len_schedule=…): the pinned slots are made again when a phase changes the
    batch's shape, every batch arrives exact; TokenDataset (one batch size a step) refuses it."""
    def make():
        return Loader(store, seq_len_schedule=[(0, 8), (3, 16)], tokens_per_step=64,
                      num_workers=0)
    fake = FakeDevice()
    with make() as ref:
        want = take(ref, 7)
    with TorchBatches(make(), torch.device("cpu"), ops=fake, depth=2) as batches:
        held = [b for _, b in zip(range(7), batches)]
        fake.drain()
        assert [tuple(b["inputs"].shape) for b in held] == [(8, 8)] * 3 + [(4, 16)] * 4
        assert same(held, want)
        assert fake.pinned_count == 2 * 3 * 2  # depth + 1 slots of 2 arrays, for each shape
    with make() as ld, pytest.raises(ConfigError, match="TokenDataset needs one batch shape"):
        TokenDataset(ld)


def test_fake_device_catches_a_buffer_refilled_too_early(store):
    fake = FakeDevice()
    fake.synchronize = lambda event: None  # the bug: refill a pinned slot without waiting
    loader = Loader(store, seq_len=L, batch_size=4, seed=1)
    batches = TorchBatches(loader, torch.device("cpu"), ops=fake, depth=2)
    held = [b for _, b in zip(range(8), batches)]
    fake.drain()
    assert not same(held, expected(loader, 8))


@pytest.mark.parametrize("ops", [None, "fake"])
def test_resumes_exactly_at_every_step_despite_batches_in_flight(store, ops):
    def make():
        loader = Loader(store, seq_len=L, batch_size=8, seed=2, epochs=2)
        fake = FakeDevice() if ops else None
        return TorchBatches(loader, torch.device("cpu"), ops=fake, depth=3), fake

    def run(batches, fake, n):
        held = [b for _, b in zip(range(n), batches)]
        if fake:
            fake.drain()
        return [{k: t.numpy().copy() for k, t in b.items()} for b in held]

    ref_batches, ref_fake = make()
    ref = run(ref_batches, ref_fake, 24)
    assert len(ref) == 24 and same(ref, expected(ref_batches.loader, 24))
    for k in range(0, 25, 3):
        a, fa = make()
        run(a, fa, k)
        state = json.loads(json.dumps(a.state_dict()))
        assert state["consumed_samples"] == 8 * k
        b, fb = make()
        b.load_state_dict(state)
        assert same(run(b, fb, 24 - k), ref[k:]), f"resume at step {k} diverged"
        a.close()
        b.close()


def test_a_second_pass_continues_after_the_last_batch_handed_out(store):
    loader = Loader(store, seq_len=L, batch_size=4, seed=6)
    batches = TorchBatches(loader, torch.device("cpu"), ops=FakeDevice(), depth=3)
    first = [b for _, b in zip(range(5), batches)]  # three more were in flight
    batches._ops.drain()
    second = [b for _, b in zip(range(4), batches)]
    batches._ops.drain()
    assert same(first + second, expected(loader, 9))


@pytest.mark.parametrize("ops", [None, "fake"])
def test_a_superseded_pass_raises_stale_iterator_as_the_loaders_own_does(store, ops):
    # before: with batches in flight the superseded pass ended quietly (a bare return), and on
    # CPU it raised the loader's "state was loaded" instead of the wrapper's own "iterated again"
    with Loader(store, seq_len=L, batch_size=4, seed=6) as loader:
        first = iter(loader)
        take(first, 2)
        iter(loader)
        with pytest.raises(StaleIterator) as want:
            next(first)
    loader = Loader(store, seq_len=L, batch_size=4, seed=6)
    with TorchBatches(loader, torch.device("cpu"), ops=FakeDevice() if ops else None,
                      depth=3) as batches:
        first = iter(batches)
        take(first, 2)  # handed out; on the fake device three more are in flight
        second = iter(batches)
        with pytest.raises(StaleIterator) as got:
            next(first)
        assert str(got.value) == str(want.value)  # "… iterated again … consumed_samples=8. …"
        held = [b for _, b in zip(range(3), second)]
        if ops:
            batches._ops.drain()  # the fake device's copies run now
        assert same(take(held), expected(loader, 3, start=8))  # the new pass goes on from there


@pytest.mark.filterwarnings("ignore:.*pin_memory")  # no accelerator on CI
@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker")  # 2 cores
@pytest.mark.parametrize("workers", [0, 1, 3])
def test_dataloader_workers_keep_the_loaders_order_to_the_end(store, workers):
    loader = Loader(store, seq_len=L, batch_size=6, seed=4, epochs=2)  # 32 steps: not a multiple of 3
    kw = dict(persistent_workers=True) if workers else {}
    dl = DataLoader(TokenDataset(loader), batch_size=None, num_workers=workers, pin_memory=True, **kw)
    got = take(dl, 100)
    assert len(dl) == 32
    assert same(got, expected(loader, 32))


@pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")  # torchdata 0.11 on torch 2.13
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_exactly(store, workers):
    loader = Loader(store, seq_len=L, batch_size=4, seed=9, layout="packed")

    def make():
        return StatefulDataLoader(TokenDataset(loader), batch_size=None, num_workers=workers)

    steps = 11
    ref = take(make(), steps)
    assert same(ref, expected(loader, steps))
    for k in (0, 1, 4, 7):
        a = make()
        it = iter(a)
        take(it, k)
        state = pickle.loads(pickle.dumps(a.state_dict()))
        del it, a
        b = make()
        b.load_state_dict(state)
        assert same(take(b, steps - k), ref[k:]), f"resume at step {k} diverged"


def test_dataset_continues_from_a_loader_state_and_survives_pickling(store):
    loader = Loader(store, seq_len=L, batch_size=4, seed=9)
    for _ in zip(range(5), loader):
        pass
    ds = TokenDataset(loader)
    assert ds.state_dict() == loader.state_dict()
    got = take(pickle.loads(pickle.dumps(ds)), 3)  # as sent to a spawned worker
    assert same(got, expected(loader, 3, start=5 * 4))


def test_bad_states_and_settings_are_refused(store, tmp_path):
    loader = Loader(store, seq_len=L, batch_size=4)
    other = Loader(store, seq_len=L, batch_size=4, seed=1)
    ds = TokenDataset(loader)
    with pytest.raises(ConfigError, match="fingerprint"):
        ds.load_state_dict(other.state_dict())
    with pytest.raises(ConfigError, match="worker 1 of 2"):
        ds.load_state_dict({**loader.state_dict(), "worker": 1, "num_workers": 2})
    with pytest.raises(ConfigError, match="depth"):
        to_torch(loader, depth=0)
    with pytest.raises(ConfigError, match="fingerprint"):
        to_torch(loader).load_state_dict(other.state_dict())
    with pytest.raises(TypeError, match="endless"):
        len(ds)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="cuda"):
            to_torch(loader, device="cuda")


@pytest.mark.parametrize("consumed", [True, 1.0, 2**63, -4, "8", None])
def test_a_dataset_refuses_what_a_loader_refuses_in_a_state(store, consumed):
    loader = Loader(store, seq_len=L, batch_size=4, seed=2)
    ds = TokenDataset(loader)
    with pytest.raises(ConfigError, match=r"consumed_samples must be an int in \[0, 2\*\*63\)"):
        ds.load_state_dict({**loader.state_dict(), "consumed_samples": consumed})
    with pytest.raises(ConfigError, match=r"consumed_samples must be an int in \[0, 2\*\*63\)"):
        loader.load_state_dict({**loader.state_dict(), "consumed_samples": consumed})
    with pytest.raises(ConfigError, match="version"):
        ds.load_state_dict({**loader.state_dict(), "version": True})


def test_a_dataset_takes_numpy_integers_as_a_loader_does(store):
    loader = Loader(store, seq_len=L, batch_size=4, seed=2)
    ds = TokenDataset(loader)
    ds.load_state_dict({**loader.state_dict(), "consumed_samples": np.int64(8)})
    assert ds.state_dict()["consumed_samples"] == 8
    assert same(take(ds, 2), expected(loader, 2, start=8))


def test_a_dataset_outlives_the_loader_it_was_made_from(store):
    loader = Loader(store, seq_len=L, batch_size=4, seed=3, epochs=1, num_workers=0)
    want = expected(loader, 5)
    ds = TokenDataset(loader)
    loader.close()  # closes the stores the loader opened: the dataset opens its own
    with pytest.raises(StoreError, match="closed"):
        loader.plan.sources[0].store.tokens(0, 1)
    assert same(take(ds, 5), want)


# ---- two real ranks --------------------------------------------------------------------------

def _rank_main(rank, world, store, rendezvous, out):
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        loader = Loader(store, seq_len=L, batch_size=4, seed=11, epochs=1)  # rank from torch.distributed
        dataset = TokenDataset(loader)
        ids = [b["inputs"][:, 0].tolist() for b in to_torch(loader)]  # first token = sample start
        via_dataset = [b["inputs"][:, 0].tolist()
                       for b in DataLoader(dataset, batch_size=None, num_workers=0)]
        gathered = [None] * world
        dist.all_gather_object(gathered, {"rank": loader.rank, "world": loader.world_size,
                                          "ids": ids, "via_dataset": via_dataset})
        if rank == 0:
            with open(out, "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_split_an_epoch_disjointly_and_completely(store, tmp_path):
    out = tmp_path / "gathered.json"
    mp.spawn(_rank_main, args=(2, str(store), str(tmp_path / "rendezvous"), str(out)), nprocs=2)
    gathered = json.loads(out.read_text())
    assert [(g["rank"], g["world"]) for g in gathered] == [(0, 2), (1, 2)]
    steps = [len(g["ids"]) for g in gathered]
    assert steps == [96 // 8] * 2  # equal step counts: one epoch of 96 samples, 8 a global step
    flat = [[s for batch in g["ids"] for s in batch] for g in gathered]
    assert not set(flat[0]) & set(flat[1])
    offset = min(flat[0] + flat[1]) % L  # the epoch's window offset: every window, once
    assert sorted(flat[0] + flat[1]) == [offset + i * L for i in range(96)]
    assert all(g["via_dataset"] == g["ids"] for g in gathered)


# ---- the guide's example runs as written ---------------------------------------------------

def test_guide_example_runs(tmp_path):
    """docs/guide-torch.md's python blocks, in order, as one script in an empty directory."""
    done = run_guide("guide-torch.md", tmp_path)
    assert "loss after 60 steps" in done.stdout
    assert "[(4, 128), (4, 128), (4, 128)]" in done.stdout  # a schedule's step 12 on 3 ranks
    assert "seq_len schedule ok" in done.stdout.splitlines()  # its block ran to its end
    assert "'epoch_tokens_left_out': 0}" in done.stdout  # and the long-context block's counts
