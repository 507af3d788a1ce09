"""torchtitan's data loader protocol, with its own classes: ``TokenmillDataLoader`` is built as its
Trainer builds a data loader, yields its ``(input_dict, labels)`` batches (the Loader's own,
rank-sliced), and is saved and restored by its ``CheckpointManager`` (DCP) in a real training
process killed with SIGKILL — the resumed run continues with exactly the batches and losses of an
uninterrupted one. torchtitan's ``Trainer`` needs CUDA and triton, so it is not run here."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.dataloader import BaseDataLoader

from conftest import read_log, stdlib_lines_store
import tokenmill
from tokenmill.load.attention import flat_position_ids
from tokenmill.base.errors import ConfigError
from tokenmill.integrations.torchtitan import TokenmillDataLoader

PROGRAM = Path(__file__).resolve().parent / "titan_program.py"
HANG = 600  # s: a run that has not paused by then hangs (a guard, not a measured time)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The lines of two standard-library modules, one document each (bytes tokenizer)."""
    return stdlib_lines_store(tmp_path_factory.mktemp("titan"), ("textwrap.py", "shlex.py"))


def build(store, layout, rank=0, world=1, **config):
    """As torchtitan's Trainer builds its data loader."""
    return TokenmillDataLoader.Config(dataset_path=store, layout=layout, **config).build(
        dp_world_size=world, dp_rank=rank, tokenizer=None, seq_len=64, local_batch_size=4,
        snapshot_every_n_steps=10)


@pytest.mark.parametrize("layout", ["concat", "packed"])
def test_batches_are_the_loaders_in_torchtitans_form(store, layout):
    dataloader = build(store, layout, rank=1, world=2, seed=7)
    assert isinstance(dataloader, BaseDataLoader) and isinstance(dataloader, Stateful)
    loader = tokenmill.Loader(store, seq_len=64, batch_size=4, layout=layout, seed=7, rank=1,
                              world_size=2)
    for (input_dict, labels), batch in zip(dataloader, [loader.batch_at(k * 8) for k in range(3)]):
        assert input_dict["input"].dtype == labels.dtype == torch.int64
        assert torch.equal(input_dict["input"], torch.from_numpy(batch["inputs"].astype("int64")))
        want = batch["targets"].astype("int64")
        if layout == "packed":
            want[batch["loss_mask"] == 0] = -100
            assert (labels == -100).any()  # padding takes no loss
            positions = torch.from_numpy(flat_position_ids(batch["segment_ids"]))
            assert torch.equal(input_dict["positions"], positions)
            # torchtitan cuts documents where positions reset to 0: exactly tokenmill's segments
            starts = torch.from_numpy(batch["segment_ids"][:, 1:] != batch["segment_ids"][:, :-1])
            real = torch.from_numpy(batch["segment_ids"][:, 1:] != 0)
            assert torch.equal(input_dict["positions"][:, 1:] == 0, starts & real)
        else:
            assert set(input_dict) == {"input"}
        assert torch.equal(labels, torch.from_numpy(want))
    dataloader.close()


def test_state_resumes_in_a_new_loader_and_on_another_number_of_ranks(store):
    first = build(store, "packed")
    batches = iter(first)
    for _ in range(3):
        next(batches)
    state = first.state_dict()
    assert list(state) == ["tokenmill"] and json.loads(state["tokenmill"])["consumed_samples"] == 12
    again = build(store, "packed")
    again.load_state_dict(state)
    assert torch.equal(next(iter(again))[0]["input"], next(batches)[0]["input"])
    # global batch 4 on 1 rank, then 2 ranks of 2 rows: rank 0 continues with the first 2 rows
    half = TokenmillDataLoader.Config(dataset_path=store, layout="packed").build(
        dp_world_size=2, dp_rank=0, tokenizer=None, seq_len=64, local_batch_size=2)
    half.load_state_dict(state)
    whole = tokenmill.Loader(store, seq_len=64, batch_size=4, layout="packed").batch_at(12)
    assert torch.equal(next(iter(half))[0]["input"],
                       torch.from_numpy(whole["inputs"][:2].astype("int64")))
    again.load_state_dict({})  # torchtitan's "nothing saved": the position stays
    with pytest.raises(ConfigError, match="not a tokenmill one"):
        again.load_state_dict({"dp_rank_0": b"...", "world_size": 1})
    with pytest.raises(ConfigError, match="needs dataset_path"):
        TokenmillDataLoader.Config().build(dp_world_size=1, dp_rank=0, seq_len=8,
                                           local_batch_size=1)
    for d in (first, again, half):
        d.close()


def run(args: dict, *, kill_when_paused: bool = False) -> list[dict]:
    """Run the training program to its end, or SIGKILL it once it has paused; its steps."""
    log = Path(args["log"])
    proc = subprocess.Popen([sys.executable, str(PROGRAM), json.dumps(args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if kill_when_paused:
        t0 = time.monotonic()
        while not any(e.get("paused") for e in read_log(log)):
            assert proc.poll() is None, proc.stderr.read().decode()[-4000:]
            assert time.monotonic() - t0 < HANG, "the training run never reached its pause"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=HANG)
    assert proc.returncode == (-signal.SIGKILL if kill_when_paused else 0), err.decode()[-4000:]
    return [e for e in read_log(log) if "step" in e]


@pytest.mark.parametrize("layout", ["concat", "packed"])
def test_sigkill_then_resume_through_torchtitans_checkpointer(store, tmp_path, layout):
    common = {"store": store, "layout": layout, "seq_len": 64, "batch_size": 4, "steps": 8,
              "interval": 3}
    whole = run({**common, "out": str(tmp_path / "a"), "log": str(tmp_path / "a.jsonl")})
    assert [e["step"] for e in whole] == list(range(1, 9))

    out = tmp_path / "b"
    killed = run({**common, "out": str(out), "log": str(tmp_path / "b.jsonl"), "pause_at": 5},
                 kill_when_paused=True)
    assert killed == whole[:5]
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == ["step-3"]
    resumed = run({**common, "out": str(out), "log": str(tmp_path / "c.jsonl")})
    assert resumed == whole[3:]  # steps 4-8: the same batches (hashes) and the same losses


def test_guide_runs_as_a_script(tmp_path):
    from conftest import run_guide
    done = run_guide("guide-torchtitan.md", tmp_path)
    assert done.stdout.strip().endswith("ok")
