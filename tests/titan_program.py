"""A training loop on torchtitan's own components, for the kill + resume test:
``python titan_program.py JSON-ARGS``.

The data loader is built as torchtitan's Trainer builds one (``config.dataloader.build(...)``), and
saved and loaded by torchtitan's ``CheckpointManager`` (DCP, every ``interval`` steps) with the
model, its ``OptimizersContainer``, its ``LRSchedulersContainer`` and the step. torchtitan's
``Trainer`` itself needs CUDA (its device defaults to "cuda" without one) and triton; this loop is
its training step on a CPU: next batch, forward, cross entropy (ignore -100), backward, step.
Logs one JSON line per step (O_APPEND): the batch's hash and the loss. With ``pause_at`` it stops
after that step's checkpoint and waits to be killed.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import xxhash
from torch import nn
from torchtitan.components.checkpointer.dcp import CheckpointManager
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from tokenmill.integrations.torchtitan import TokenmillDataLoader


class TrainState:
    """The step, saved with the checkpoint (torchtitan's Trainer saves itself as "train_state")."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state):
        self.step = int(state["step"])


class Tiny(nn.Module):
    """Embedding → the position's embedding added → linear head: reads ``positions`` as RoPE would."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(258, 16), nn.Embedding(512, 16), nn.Linear(16, 258)

    def forward(self, tokens, positions=None):
        if positions is None:  # concat rows: one stream, positions 0 … L-1
            positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        return self.head(self.tok(tokens) + self.pos(positions))


def main(a: dict) -> None:
    log = os.open(a["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    dist.init_process_group("gloo", init_method=f"file://{a['out']}.pg", rank=0, world_size=1)
    torch.manual_seed(0)
    model = Tiny()
    dataloader = TokenmillDataLoader.Config(dataset_path=a["store"], layout=a["layout"]).build(
        dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=a["seq_len"],
        local_batch_size=a["batch_size"], snapshot_every_n_steps=a["interval"])
    groups = [ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})]
    optimizers = OptimizersContainer.Config(implementation="for-loop",
                                            param_groups=groups).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers,
                                                                     training_steps=a["steps"])
    state = TrainState()
    checkpoints = CheckpointManager.Config(enable=True, folder="checkpoint",
                                           interval=a["interval"]).build(
        dataloader=dataloader, model_parts=[model], optimizers=optimizers,
        lr_schedulers=schedulers, states={"train_state": state}, sd_adapter=None,
        base_folder=a["out"])
    checkpoints.load(step=-1)  # the latest, if any
    batches = iter(dataloader)
    while state.step < a["steps"]:
        state.step += 1
        input_dict, labels = next(batches)
        logits = model(input_dict["input"], input_dict.get("positions"))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        digest = xxhash.xxh3_64(input_dict["input"].numpy().tobytes()).hexdigest()
        os.write(log, (json.dumps({"step": state.step, "hash": digest, "loss": loss.item()})
                       + "\n").encode())
        checkpoints.save(state.step)
        if state.step == a.get("pause_at"):
            os.write(log, b'{"paused": true}\n')
            while True:
                time.sleep(1)
    checkpoints.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
