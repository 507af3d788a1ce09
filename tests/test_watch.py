"""The stall across ranks (2 gloo ranks, rank 1 slowed on purpose) and the Chrome trace."""

import json
import socket
import subprocess
import sys
import textwrap

import pytest

from tokenmill.errors import ConfigError
from tokenmill.watch import Watch, slowest

RANK = textwrap.dedent("""
    import json, sys, time
    import torch.distributed as dist
    from tokenmill.watch import Watch
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
