"""A training script with ``transformers.Trainer`` on a tokenmill store, for the kill + resume
test: ``python hf_trainer_program.py JSON-ARGS``.

Logs (one JSON line each, O_APPEND: a SIGKILL tears at most the last line) every batch the
collator builds (``fetched``: it may run ahead of training, in DataLoader workers) and every batch
the model trains on (``trained``, with the optimizer step it makes). With ``pause_at`` it stops at
the end of that step (logging ``paused``) and waits to be killed.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import transformers
import xxhash

import tokenmill
from tokenmill.hf import LoaderCallback, TrainerDataset, collate


def digest(tensor: torch.Tensor) -> str:
    """xxh3-64 of a tensor's bytes."""
    return xxhash.xxh3_64(tensor.contiguous().numpy().tobytes()).hexdigest()


class Log:
    """One JSON line per event, appended in one write."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def __call__(self, **event) -> None:
        os.write(self.fd, (json.dumps({"pid": os.getpid(), **event}) + "\n").encode())


class Collate:
    """``collate``, logging each batch it builds (a class: DataLoader workers pickle it)."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, rows):
        batch = collate(rows)
        Log(self.path)(event="fetched", hash=digest(batch["input_ids"]))
        return batch


class LoggedTrainer(transformers.Trainer):
    """Logs the batch of every training step, with the optimizer step it makes."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.log_event(event="trained", step=self.state.global_step + 1,
                       hash=digest(inputs["input_ids"]))
        return super().training_step(model, inputs, num_items_in_batch)


class PauseAt(transformers.TrainerCallback):
    """Stops at the end of step ``step`` and waits to be killed."""

    def __init__(self, step: int, log: Log):
        self.step, self.log = step, log

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.log(event="paused", step=state.global_step)
            while True:
                time.sleep(1)


def model_from_config() -> transformers.LlamaForCausalLM:
    """A 2-layer Llama with random weights, seed 0 (nothing downloaded)."""
    config = transformers.LlamaConfig(
        vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def main(a: dict) -> None:
    log = Log(a["log"])
    loader = tokenmill.Loader(a["store"], seq_len=a["seq_len"], batch_size=a["batch_size"],
                              layout=a["layout"], seed=3)
    rows = TrainerDataset(loader)
    args = transformers.TrainingArguments(
        a["out"], per_device_train_batch_size=a["batch_size"], max_steps=a["max_steps"],
        save_steps=a["save_steps"], save_strategy="steps", logging_steps=1, report_to=[],
        dataloader_num_workers=a["workers"], use_cpu=True, learning_rate=1e-3, seed=0,
        disable_tqdm=True)
    callbacks = [LoaderCallback(rows)] + ([PauseAt(a["pause_at"], log)] if a.get("pause_at") else [])
    trainer = LoggedTrainer(model=model_from_config(), args=args, train_dataset=rows,
                            data_collator=Collate(a["log"]), callbacks=callbacks)
    trainer.log_event = log
    log(event="start")
    trainer.train(resume_from_checkpoint=a.get("resume"))
    log(event="done", step=trainer.state.global_step)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
