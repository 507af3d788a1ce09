"""Every rank's loader agrees (issue 22, class 10): a script in nanoGPT's habit (``seed=1337 +
rank``) under torchrun is refused on every rank at its first batch, naming the rank and the
setting; identical settings give the batches they always gave. Real ranks: ``torchrun`` with
gloo on CPU, and two JAX processes (gloo collectives on CPU).

This file is also the script those ranks run (``python test_ranks.py torch|jax OUT STORE TEXT
SCENARIO…``): each rank runs the scenarios in order, catching a ConfigError per scenario, and
writes what it saw to ``OUT/rank<r>.json``; a scenario that refuses on every rank at once keeps
the ranks in step, so the next scenario's collective meets (no rank left waiting).
"""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve()
L, B = 8, 2  # seq_len; per-rank batch
TIMEOUT_S = 300  # a hang fails the test instead of the suite


# ---- the checks, as pure functions --------------------------------------------------------------

def test_the_rank_that_differs_is_named_with_its_setting_and_what_to_do():
    from tokenmill.load.ranks import disagreement
    rows = [{"rank": r, "seq_len": 8, "seed": 1337 + r} for r in range(2)]
    msg = disagreement(rows)
    assert msg.startswith("ranks disagree: rank 1's Loader has seed=1338 where rank 0's has "
                          "seed=1337; use the same seed on every rank (seed=1337, not 1337 + rank)")
    odd = [{"rank": r, "seed": 7 if r == 2 else 0} for r in range(3)]
    assert "rank 2's Loader has seed=7 where rank 0's has seed=0;" in disagreement(odd)
    odd0 = [{"rank": r, "seed": 7 if r == 0 else 0} for r in range(3)]  # the majority decides
    assert "rank 0's Loader has seed=7 where rank 1's has seed=0;" in disagreement(odd0)
    every = [{"rank": r, "seed": r} for r in range(9)]
    assert "(ranks differing from rank 0: 1, 2, 3, 4 and 4 more)" in disagreement(every)
    assert disagreement([{"rank": r, "seed": 5, "stores": ["f"]} for r in range(4)]) is None


def test_ranks_given_twice_or_out_of_range_are_named():
    from tokenmill.load.ranks import rank_clash
    assert rank_clash([0, 1, 2]) is None and rank_clash([2, 0, 1]) is None
    assert rank_clash([0, 0]).startswith("ranks 0, 1 both made their Loader with rank=0 "
                                         "(world_size=2), and no rank reads the slice of rank=1:")
    assert rank_clash([0, 1, 1]).startswith("ranks 1, 2 both made their Loader with rank=1")
    assert rank_clash([0, 3, 2]).startswith("rank 1 made its Loader with rank=3 (world_size=3), "
                                            "and no rank reads the slice of rank=1")


def test_jax_rows_travel_as_int32_pairs_and_compare_as_the_values_would():
    from tokenmill.load.ranks import Hashed, decoded, disagreement, encoded
    mine = {"rank": 1, "seed": 2**40, "layout": "packed", "stores": ["ab", "cd"], "max": None}
    pairs = encoded(mine)
    assert pairs.dtype == np.int32 and pairs.shape == (10,)
    row = decoded(pairs, list(mine))[0]
    assert row["rank"] == 1 and isinstance(row["seed"], Hashed) and row == decoded(
        encoded(dict(mine)), list(mine))[0]
    other = decoded(encoded({**mine, "rank": 0, "seed": 2**40 + 1}), list(mine))[0]
    assert "rank 1's Loader has seed=<value hashed" in disagreement([other, row])
    small = [decoded(encoded({"rank": r, "seed": 1337 + r}), ["rank", "seed"])[0] for r in (0, 1)]
    assert "rank 1's Loader has seed=1338 where rank 0's has seed=1337" in disagreement(small)


def test_one_process_and_no_process_group_check_nothing(tmp_path):
    from conftest import write_positional_store
    from tokenmill.load.loader import Loader
    store = write_positional_store(tmp_path / "s", [40] * 10)
    # no process group: rank and world_size as given, nothing gathered, batches as ever
    with Loader(store, seq_len=L, batch_size=B, seed=1338, rank=1, world_size=2) as loader:
        assert np.array_equal(next(iter(loader))["inputs"], loader.batch_at(0)["inputs"])


# ---- real ranks ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A positional store (token = global position: 96 concat samples of L) and a text file."""
    from conftest import lengths_summing_to, stdlib_texts, write_positional_store
    d = tmp_path_factory.mktemp("ranks")
    lengths = lengths_summing_to(97 * L, docs=30, longest=40, seed=5)
    store = write_positional_store(d / "store", lengths, shard_tokens=300)
    text = d / "text.jsonl"
    text.write_text("".join(json.dumps({"text": t}) + "\n" for t in stdlib_texts(50_000)))
    return store, text


def run_ranks(kind, n, scenarios, data, tmp_path):
    """Run the scenarios on ``n`` real ranks (torchrun, or n JAX processes); what each saw."""
    out = tmp_path / "out"
    out.mkdir()
    store, text = data
    args = [str(out), str(store), str(text), *scenarios]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get(
        "PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    if kind == "torch":
        procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   f"--nproc-per-node={n}", str(HERE), "torch", *args],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True)]
    else:
        with socket.socket() as s:  # a free port on the loopback for the coordinator
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
                   TM_JAX=f"{port},{n}")
        procs = [subprocess.Popen([sys.executable, str(HERE), "jax", *args],
                                  env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True)
                 for r in range(n)]
    for p in procs:
        try:
            _, err = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, signal.SIGKILL)
            raise AssertionError(f"the ranks hung ({kind}, {n} ranks, {scenarios})") from None
        assert p.returncode == 0, err[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def expected(store, n):
    """Each rank's batches of one epoch (seed 1337), from the pure plan in this one process."""
    from tokenmill.load.loader import Loader
    loaders = [Loader(store, seq_len=L, batch_size=B, seed=1337, rank=r, world_size=n)
               for r in range(n)]
    return [[lo.batch_at(k * B * n)["inputs"].tolist() for k in range(96 // (B * n))]
            for lo in loaders]


def assert_same_batches_as_ever(seen, store, n, key="same"):
    want = expected(store, n)
    assert [s[key] for s in seen] == want
    starts = sorted(row[0] for rank in want for batch in rank for row in batch)
    assert len(starts) == len(set(starts)) == 96  # every sample once, ranks disjoint


def refused(seen, scenario):
    """The message every rank raised in ``scenario`` (the same on each)."""
    messages = {s[scenario] for s in seen}
    assert len(messages) == 1, messages
    return messages.pop()


def test_two_torchrun_ranks_refuse_per_rank_seeds_and_keep_batches(data, tmp_path):
    seen = run_ranks("torch", 2, ["same", "seed_per_rank", "stream_seed_per_rank",
                                  "dataset_seed_per_rank", "same_rank_given", "other_position",
                                  "same_again"], data, tmp_path)
    assert_same_batches_as_ever(seen, data[0], 2)
    assert_same_batches_as_ever(seen, data[0], 2, key="same_again")  # nobody left waiting
    msg = refused(seen, "seed_per_rank")
    assert msg.startswith("ConfigError: ranks disagree: rank 1's Loader has seed=1338 where "
                          "rank 0's has seed=1337; use the same seed on every rank"), msg
    assert all(s["seed_per_rank_again"] == msg for s in seen)  # the pass stays refused
    assert refused(seen, "stream_seed_per_rank").startswith(
        "ConfigError: ranks disagree: rank 1's stream loader has seed=1338 where rank 0's has "
        "seed=1337")
    assert refused(seen, "dataset_seed_per_rank").startswith(
        "ConfigError: ranks disagree: rank 1's Loader has seed=1338")
    assert refused(seen, "same_rank_given").startswith(
        "ConfigError: ranks 0, 1 both made their Loader with rank=0 (world_size=2), and no rank "
        "reads the slice of rank=1: give each process its own rank")
    assert refused(seen, "other_position").startswith(
        "ConfigError: ranks disagree: rank 1's Loader has consumed_samples=8 where rank 0's has "
        "consumed_samples=4; every rank must start at the same step")


def test_three_torchrun_ranks_name_every_rank_that_differs(data, tmp_path):
    seen = run_ranks("torch", 3, ["seed_per_rank", "one_odd_seed", "same"], data, tmp_path)
    assert refused(seen, "seed_per_rank").startswith(
        "ConfigError: ranks disagree: rank 1's Loader has seed=1338 where rank 0's has "
        "seed=1337 (ranks differing from rank 0: 1, 2); use the same seed")
    assert refused(seen, "one_odd_seed").startswith(
        "ConfigError: ranks disagree: rank 2's Loader has seed=0 where rank 0's has seed=1337;")
    assert_same_batches_as_ever(seen, data[0], 3)


def test_two_jax_processes_refuse_per_rank_seeds_and_keep_batches(data, tmp_path):
    seen = run_ranks("jax", 2, ["same", "seed_per_rank", "same_again"], data, tmp_path)
    assert_same_batches_as_ever(seen, data[0], 2)
    assert_same_batches_as_ever(seen, data[0], 2, key="same_again")
    assert refused(seen, "seed_per_rank").startswith(
        "ConfigError: ranks disagree: rank 1's Loader has seed=1338 where rank 0's has "
        "seed=1337; use the same seed")


# ---- what each rank runs ----------------------------------------------------------------------

def rank_main(kind, out, store, text, scenarios):
    """Join the group, run the scenarios, write what this rank saw."""
    if kind == "torch":
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        explicit = {}  # rank and world_size from torch.distributed
    else:
        import jax
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        port, n = os.environ["TM_JAX"].split(",")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=int(n),
                                   process_id=int(os.environ["RANK"]))
        rank, world = jax.process_index(), jax.process_count()
        explicit = {"rank": rank, "world_size": world}  # the JAX way: given
    seen = {}
    for name in scenarios:
        try:
            seen[name] = SCENARIOS[name](rank, world, store, text, out, explicit, seen)
        except Exception as e:
            if type(e).__name__ != "ConfigError":
                raise
            seen[name] = f"ConfigError: {e}"
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(seen))
    if kind == "torch":
        dist.destroy_process_group()
    else:
        jax.distributed.shutdown()


def _loader(store, explicit, **kw):
    from tokenmill.load.loader import Loader
    return Loader(store, seq_len=L, batch_size=B, epochs=1, **{**explicit, **kw})


def same(rank, world, store, text, out, explicit, seen):
    with _loader(store, explicit, seed=1337) as loader:
        return [b["inputs"].tolist() for b in loader]


def seed_per_rank(rank, world, store, text, out, explicit, seen):
    loader = _loader(store, explicit, seed=1337 + rank)  # nanoGPT's habit
    it = iter(loader)
    try:
        next(it)
    except Exception as e:
        try:
            next(it)  # the same iterator: refused again, never a quiet end
        except Exception as again:
            seen["seed_per_rank_again"] = f"{type(again).__name__}: {again}"
        raise e
    return "handed out a batch"


def stream_seed_per_rank(rank, world, store, text, out, explicit, seen):
    from tokenmill.load.loader import Loader
    loader = Loader.from_text(text, tokenizer="bytes", seq_len=L, batch_size=B,
                              cache_dir=Path(out) / f"cache{rank}", seed=1337 + rank,
                              num_workers=0, **explicit)
    with loader:
        next(iter(loader))
    return "handed out a batch"


def dataset_seed_per_rank(rank, world, store, text, out, explicit, seen):
    from tokenmill.integrations.torch import TokenDataset
    TokenDataset(_loader(store, explicit, seed=1337 + rank))
    return "made the dataset"


def same_rank_given(rank, world, store, text, out, explicit, seen):
    with _loader(store, {}, seed=1337, rank=0, world_size=world) as loader:
        next(iter(loader))
    return "handed out a batch"


def other_position(rank, world, store, text, out, explicit, seen):
    with _loader(store, explicit, seed=1337) as loader:
        state = loader.state_dict()
        step = B * world  # rank 0 loads the state of step 1, the others that of step 2
        loader.load_state_dict({**state, "consumed_samples": step * (2 if rank else 1)})
        next(iter(loader))
    return "handed out a batch"


def one_odd_seed(rank, world, store, text, out, explicit, seen):
    with _loader(store, explicit, seed=0 if rank == 2 else 1337) as loader:
        next(iter(loader))
    return "handed out a batch"


SCENARIOS = {"same": same, "same_again": same, "seed_per_rank": seed_per_rank,
             "stream_seed_per_rank": stream_seed_per_rank,
             "dataset_seed_per_rank": dataset_seed_per_rank, "same_rank_given": same_rank_given,
             "other_position": other_position, "one_odd_seed": one_odd_seed}

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rank_main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), sys.argv[5:])
