"""The stall across ranks (2 gloo ranks, rank 1 slowed on purpose) and the Chrome trace."""

import json
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tokenmill.base.errors import ConfigError
from tokenmill.observe.watch import Watch, slowest

RANK = textwrap.dedent("""
    import json, sys, time
    import torch.distributed as dist
    from tokenmill.observe.watch import Watch
    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)

    def batches():
        while True:
            if rank == 1:
                time.sleep(0.02)  # the slow rank: its data comes late
            yield {"inputs": [0]}

    lines = []
    w = Watch(batches(), every=10, trace=out + "/trace-{rank}.json", log=lines.append)
    for step, _ in zip(range(30), w):
        time.sleep(0.002)
        dist.barrier()  # the all-reduce of a data-parallel step: the fast rank waits here
    w.close()
    json.dump({"last": w.last, "lines": lines}, open(f"{out}/rank{rank}.json", "w"))
    dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_ranks_name_the_slow_rank_and_stage_and_write_a_trace(tmp_path):
    pytest.importorskip("torch.distributed")
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), port, str(tmp_path)])
             for r in (0, 1)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    for r in (0, 1):
        last = json.loads((tmp_path / f"rank{r}.json").read_text())["last"]
        assert last["rank"] == 1 and last["stage"] == "data wait" and last["step"] == 20
        assert last["seconds"] >= 10 * 0.02 * 0.9  # 10 steps of 20 ms late data
    lines = json.loads((tmp_path / "rank0.json").read_text())["lines"]
    assert len(lines) == 2 and "slowest rank 1 in data wait" in lines[-1]
    for r in (0, 1):
        events = json.loads((tmp_path / f"trace-{r}.json").read_text())["traceEvents"]
        assert events[0] == {"name": "process_name", "ph": "M", "pid": r,
                             "args": {"name": f"rank {r}"}}
        spans = [e for e in events[1:] if e["ph"] == "X"]
        assert {e["name"] for e in spans} == {"data wait", "step", "all_gather"}
        assert all(e["pid"] == r and e["dur"] >= 0 for e in spans)
        waits = sorted(e["dur"] for e in spans if e["name"] == "data wait")
        assert (waits[len(waits) // 2] >= 15_000) == (r == 1)  # µs: only rank 1's data is late


def test_slowest_prefers_data_stages_and_falls_back_to_the_step():
    assert slowest([{"data wait": 0.1, "step": 2.0}, {"data wait": 0.5, "step": 1.0}]) \
        ["stage"] == "data wait"
    s = slowest([{"data wait": 0.1, "step": 1.0}, {"data wait": 0.1, "step": 3.0}, {"step": 1.0}])
    assert (s["rank"], s["stage"], s["median_s"]) == (1, "step", 1.0)


def test_one_rank_without_a_process_group_and_bad_every(tmp_path):
    w = Watch(iter(range(25)), every=10, trace=tmp_path / "t-{rank}.json", log=None)
    assert list(w) == list(range(25)) and w.last["step"] == 20 and w.rank == 0
    assert (tmp_path / "t-0.json").exists()
    with pytest.raises(ConfigError, match="every"):
        Watch([], every=0)


def spans(events, tid=None):
    return [e for e in events if e["ph"] == "X" and (tid is None or e["tid"] == tid)]


def inside(inner, outer) -> bool:
    return outer["ts"] <= inner["ts"] and \
        inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3  # µs rounding


def properly_nested(row) -> bool:
    """No two spans on one thread's row overlap partially (each pair: disjoint or nested)."""
    row = sorted(row, key=lambda e: (e["ts"], -e["dur"]))
    open_ = []
    for e in row:
        while open_ and e["ts"] >= open_[-1]["ts"] + open_[-1]["dur"] - 1e-3:
            open_.pop()
        if open_ and not inside(e, open_[-1]):
            return False
        open_.append(e)
    return True


@pytest.mark.parametrize("ahead", [False, True])
def test_the_trace_has_the_loaders_stages_nested_in_each_steps_data_wait(tmp_path, ahead,
                                                                        monkeypatch):
    from conftest import write_positional_store
    from tokenmill import Loader
    from tokenmill.load import pacing
    store = write_positional_store(tmp_path / "s", [40] * 200, shard_tokens=1000)
    if ahead:  # every batch "costly": the default hands them to its worker thread
        monkeypatch.setattr(pacing, "handoff_cost", lambda submit, kind="thread": -1.0)
        monkeypatch.setattr(pacing, "AHEAD_TRIAL", 10**9)  # and stays there, whatever the waits
        monkeypatch.setattr(pacing, "WAIT_FRACTION", 0.0)
    loader = Loader(store, seq_len=16, batch_size=4, **({} if ahead else {"num_workers": 0}))
    with Watch(loader, every=10, trace=tmp_path / "t-{rank}.json", log=None) as w:
        for _ in zip(range(30), w):
            time.sleep(0.001)
    events = json.loads((tmp_path / "t-0.json").read_text())["traceEvents"]
    waits = spans(events, 0)
    by_tid = {}
    for e in spans(events):
        by_tid.setdefault(e["tid"], []).append(e)
    assert all(properly_nested(row) for row in by_tid.values())
    data = [e for e in waits if e["name"] == "data wait"]
    steps = [e for e in waits if e["name"] == "step"]
    assert len(data) == 30 and len(steps) == 29  # every step covered: its wait, then its step
    assert all(d["ts"] + d["dur"] <= s["ts"] + 1e-3 for d, s in zip(data, steps))
    for name in ("plan", "gather"):  # each batch planned and gathered once, somewhere
        assert len([e for e in spans(events) if e["name"] == name]) >= 30
    stages = [e for e in waits if e["name"] in ("plan", "gather", "wait")]
    assert all(any(inside(e, d) for d in data) for e in stages)  # main thread: inside a wait
    workers = {e["tid"] for e in spans(events) if e["name"] == "gather"} - {0}
    assert workers == ({2} if ahead else set())
    if ahead:
        assert loader.stats()["mode"] == "ahead"
        assert len([e for e in waits if e["name"] == "wait"]) >= 25
        names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
        assert names[0] == "training loop" and names[2] == "loader worker 1"
    loader.close()
