"""``transformers.Trainer`` fed by a tokenmill Loader (``tokenmill.hf``): the Trainer trains on the
loader's own batches (its losses equal the same batches fed by hand to a same-seeded model), and a
training process killed with SIGKILL after a checkpoint, resumed from that checkpoint, trains on
exactly the batches an uninterrupted run trains on, computing none of those before the checkpoint
again (no replay). Tiny Llama models built from a config; nothing downloaded."""

import json
import os
import signal
import subprocess
import sys
import time
from itertools import islice
from pathlib import Path

import pytest
import torch
import transformers

from conftest import read_log, stdlib_lines_store
import tokenmill
from tokenmill.base.errors import ConfigError
from tokenmill.hf import LoaderCallback, Row, TrainerDataset, collate
from tokenmill.integrations.torch import hf_inputs

PROGRAM = Path(__file__).resolve().parent / "hf_trainer_program.py"
SEQ_LEN, BATCH = 64, 4
HANG = 600  # s: a run that has not paused by then hangs (a guard, not a measured time)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The lines of three standard-library modules, one document each (bytes tokenizer)."""
    return stdlib_lines_store(tmp_path_factory.mktemp("hf-trainer"))


def loader_of(store, layout):
    return tokenmill.Loader(store, seq_len=SEQ_LEN, batch_size=BATCH, layout=layout, seed=3)


def model_from_config():
    sys.path.insert(0, str(PROGRAM.parent))
    from hf_trainer_program import model_from_config as build
    return build()


class LossRecorder(transformers.Trainer):
    """Keeps the loss of every batch the Trainer trains on."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.losses.append(loss.detach().clone())
        return loss


def sgd_args(out, steps, **kw):
    """Plain SGD, constant rate, no clipping: what a hand-written loop does too."""
    return transformers.TrainingArguments(
        str(out), per_device_train_batch_size=BATCH, max_steps=steps, optim="sgd",
        learning_rate=0.05, lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
        report_to=[], use_cpu=True, disable_tqdm=True, seed=0, **kw)


@pytest.mark.parametrize("layout", ["concat", "packed"])
def test_trainer_losses_equal_the_loaders_batches_fed_by_hand(store, layout, tmp_path):
    steps = 4
    rows = TrainerDataset(loader_of(store, layout))
    trainer = LossRecorder(model=model_from_config(), args=sgd_args(tmp_path, steps, save_strategy="no"),
                           train_dataset=rows, data_collator=collate, callbacks=[LoaderCallback(rows)])
    trainer.losses = []
    trainer.train()

    model = model_from_config().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    by_hand = []
    with loader_of(store, layout) as loader:
        for batch in islice(loader, steps):
            kwargs = hf_inputs(batch)
            if layout == "packed":
                assert kwargs["position_ids"].shape == (1, BATCH * SEQ_LEN)
            count = (kwargs["shift_labels"] != -100).sum()
            loss = model(**kwargs, num_items_in_batch=count).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            by_hand.append(loss.detach())
    assert len(trainer.losses) == steps
    assert torch.equal(torch.stack(trainer.losses), torch.stack(by_hand))
    trained = dict(trainer.model.named_parameters())
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, LoaderCallback))
    assert callback.state()["attributes"] == {"step": steps,  # what a checkpoint now would hold
                                              "loader": rows.state_at(steps * BATCH)}


def run(args: dict, *, kill_when_paused: bool = False) -> list[dict]:
    """Run the training program to its end, or SIGKILL it once it has paused; its events."""
    log = Path(args["log"])
    proc = subprocess.Popen([sys.executable, str(PROGRAM), json.dumps(args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if kill_when_paused:
        t0 = time.monotonic()
        while not any(e["event"] == "paused" for e in read_log(log)):
            assert proc.poll() is None, proc.stderr.read().decode()[-4000:]
            assert time.monotonic() - t0 < HANG, "the training run never reached its pause"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=HANG)
    if kill_when_paused:
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == 0, err.decode()[-4000:]
    return read_log(log)


def trained(events) -> dict[int, str]:
    """step → hash of the batch trained on at that step."""
    return {e["step"]: e["hash"] for e in events if e["event"] == "trained"}


@pytest.mark.slow
@pytest.mark.parametrize("layout, workers", [("concat", 0), ("packed", 2)])
def test_sigkill_after_a_checkpoint_then_resume_trains_on_the_same_batches(store, tmp_path,
                                                                           layout, workers):
    common = {"store": store, "seq_len": SEQ_LEN, "batch_size": BATCH, "layout": layout,
              "max_steps": 8, "save_steps": 3, "workers": workers}
    whole = run({**common, "out": str(tmp_path / "a"), "log": str(tmp_path / "a.jsonl")})
    want = trained(whole)
    assert sorted(want) == list(range(1, 9)) and len(set(want.values())) == 8

    out, log = tmp_path / "b", tmp_path / "b.jsonl"
    killed = run({**common, "out": str(out), "log": str(log), "pause_at": 5}, kill_when_paused=True)
    assert trained(killed) == {s: want[s] for s in range(1, 6)}
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3"]  # killed at step 5
    saved = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    state = saved["stateful_callbacks"]["LoaderCallback"]["attributes"]
    assert state["step"] == 3 and state["loader"]["consumed_samples"] == 3 * BATCH

    log.unlink()
    resumed = run({**common, "out": str(out), "log": str(log), "resume": True})  # the last one
    assert trained(resumed) == {s: want[s] for s in range(4, 9)}
    fetched = [e["hash"] for e in resumed if e["event"] == "fetched"]
    before = {want[s] for s in range(1, 4)}
    assert fetched and not before & set(fetched)  # nothing before the checkpoint recomputed
    if workers == 0:  # one process: batches are built in order, from the checkpoint on
        assert fetched[:5] == [want[s] for s in range(4, 9)]


def test_wrong_settings_and_a_checkpoint_without_loader_state_are_refused(store, tmp_path):
    rows = TrainerDataset(loader_of(store, "concat"))
    with pytest.raises(ConfigError, match="per_device_train_batch_size=2 but the Loader's "
                                          "batch_size is 4"):
        args = sgd_args(tmp_path / "x", 2)
        args.per_device_train_batch_size = 2
        transformers.Trainer(model=model_from_config(), args=args, train_dataset=rows,
                             data_collator=collate, callbacks=[LoaderCallback(rows)]).train()
    with pytest.raises(ConfigError, match="restore_callback_states_from_checkpoint=True"):
        transformers.Trainer(model=model_from_config(),
                             args=sgd_args(tmp_path / "y", 2,
                                           restore_callback_states_from_checkpoint=True),
                             train_dataset=rows, data_collator=collate,
                             callbacks=[LoaderCallback(rows)])
    with pytest.raises(ConfigError, match="collate takes the rows of a tokenmill TrainerDataset"):
        collate([{"input_ids": torch.zeros(3)}])

    out = tmp_path / "z"
    rows = TrainerDataset(loader_of(store, "concat"))
    transformers.Trainer(model=model_from_config(), args=sgd_args(out, 2, save_steps=1),
                         train_dataset=rows, data_collator=collate,
                         callbacks=[LoaderCallback(rows)]).train()
    path = out / "checkpoint-1" / "trainer_state.json"
    saved = json.loads(path.read_text())
    del saved["stateful_callbacks"]["LoaderCallback"]
    path.write_text(json.dumps(saved))
    rows = TrainerDataset(loader_of(store, "concat"))
    trainer = transformers.Trainer(model=model_from_config(), args=sgd_args(out, 2),
                                   train_dataset=rows, data_collator=collate,
                                   callbacks=[LoaderCallback(rows)])
    with pytest.raises(ConfigError, match="the checkpoint of step 1 holds no tokenmill loader "
                                          "state"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-1"))


def test_a_pass_that_reached_the_end_leaves_nothing_to_repeat(store):
    loader = tokenmill.Loader(store, seq_len=SEQ_LEN, batch_size=BATCH, epochs=1)
    rows = TrainerDataset(loader)
    first = list(rows)
    assert len(first) == loader.total_steps * BATCH and isinstance(first[0], Row)
    assert list(rows) == []  # a Trainer asking for another epoch gets no repeat
    with pytest.raises(TypeError, match="max_steps"):
        len(rows)


def test_guide_runs_as_a_script(tmp_path):
    from conftest import run_guide
    done = run_guide("guide-hf.md", tmp_path)
    assert done.stdout.strip().endswith("ok")
