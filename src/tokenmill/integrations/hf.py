"""Hugging Face ``transformers.Trainer`` fed by a tokenmill Loader, its position saved in and
restored from the Trainer's own checkpoints.

    rows = TrainerDataset(Loader("store/", seq_len=2048, batch_size=8, layout="packed"))
    trainer = Trainer(model=model, args=TrainingArguments(out, per_device_train_batch_size=8,
                                                          max_steps=1000, save_steps=100),
                      train_dataset=rows, data_collator=collate, callbacks=[LoaderCallback(rows)])
    trainer.train(resume_from_checkpoint=True)   # after a crash: the same batches as before it

``TrainerDataset`` hands the Trainer the loader's batches row by row (``Row``: a tuple, so the
Trainer's ``remove_unused_columns`` leaves it whole); ``per_device_train_batch_size`` rows make one
batch, the loader's own, with any ``dataloader_num_workers`` (worker w computes steps w, w+N, …, as
``TokenDataset``). ``collate`` stacks them and returns ``hf_inputs(batch)``: concat rows as they
are; packed rows flattened to one with ``position_ids`` restarting at each document, and
``shift_labels`` that the Trainer also counts to scale the loss.

Resume. On ``resume_from_checkpoint`` transformers (4.5x to 5.x) fast-forwards the data by
replaying it: accelerate's ``skip_first_batches`` iterates the dataloader and drops the batches
already trained on, unless ``TrainingArguments.ignore_data_skip``. A tokenmill stream needs no
replay (batch k is a pure function of k), so ``LoaderCallback``:

- sets ``ignore_data_skip=True`` (at ``on_init_end``; again at ``on_train_begin`` for a callback
  added later) — kept, the replay would skip that many batches *past* the restored position;
- is an ``ExportableState``: the Trainer writes its ``state()`` — the loader's state as of the last
  optimizer step — into each checkpoint's ``trainer_state.json`` (``stateful_callbacks``), in the
  same file as the step it belongs to;
- at ``on_train_begin`` of a resumed run reads that state back from the loaded trainer state and
  starts the dataset there (fingerprint and settings checked as any tokenmill resume).

The state counts optimizer steps, not batches fetched: accelerate and DataLoader workers fetch
ahead, and what the model has trained on is ``global_step × gradient_accumulation_steps`` batches.
One process only: with several, accelerate splits an IterableDataset's batches itself (rank 0
reads and dispatches), which would cut each rank's tokenmill slice again; refused, not guessed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from tokenmill.base.errors import ConfigError
from tokenmill.integrations.torch import TokenDataset, hf_inputs
from tokenmill.load.loader import STATE_VERSION, Loader

__all__ = ["LoaderCallback", "Row", "TrainerDataset", "collate"]


class Row(NamedTuple):
    """One row of a tokenmill batch, its tensors by key (``inputs``, ``targets``, …)."""

    arrays: dict[str, torch.Tensor]


class TrainerDataset(TokenDataset):
    """A Loader's batches as rows for ``Trainer(train_dataset=…, data_collator=collate)``.

    No ``len()``: give the Trainer ``max_steps``. A finished pass leaves the dataset at the end of
    the loader's epochs, so a Trainer that asks for another epoch gets nothing, not a repeat.
    """

    def __init__(self, loader: Loader):
        super().__init__(loader)
        self.batch_size = loader.batch_size

    def __len__(self) -> int:
        """None: the Trainer counts steps (``max_steps``), never rows of an epoch."""
        raise TypeError("a TrainerDataset has no len(): give TrainingArguments(max_steps=N)")

    def __iter__(self) -> Iterator[Row]:
        for batch in super().__iter__():
            for i in range(self.batch_size):
                yield Row({k: v[i] for k, v in batch.items()})
        if self.total_steps is not None:  # the pass reached the end: later passes start there
            self._start, self._own = self.total_steps * self.global_batch_size, False

    @property
    def position(self) -> int:
        """The sample where the next pass starts (the Loader's ``consumed_samples``)."""
        return self._start

    def state_at(self, consumed: int) -> dict[str, Any]:
        """This stream's state (the Loader's shape) with ``consumed`` samples consumed."""
        return {"version": STATE_VERSION, "consumed_samples": int(consumed),
                "fingerprint": self.fingerprint, "stream": self._stream}


def collate(rows: Sequence[Row]) -> dict[str, Any]:
    """The Trainer's ``data_collator`` for a ``TrainerDataset``: rows stacked → ``hf_inputs``.

    collate([Row({"inputs": x, "targets": y})])["input_ids"].shape == (1, len(x))
    """
    if not rows or not all(isinstance(r, Row) for r in rows):
        got = type(rows[0]).__name__ if rows else "no rows"
        raise ConfigError(f"collate takes the rows of a tokenmill TrainerDataset (got {got}); "
                          "pass train_dataset=TrainerDataset(loader) with data_collator=collate")
    return hf_inputs({k: torch.stack([r.arrays[k] for r in rows]) for k in rows[0].arrays})


class LoaderCallback(TrainerCallback, ExportableState):
    """Saves a ``TrainerDataset``'s position in every Trainer checkpoint and resumes from it."""

    def __init__(self, dataset: TrainerDataset):
        if not isinstance(dataset, TrainerDataset):
            raise ConfigError(f"LoaderCallback takes the TrainerDataset given to the Trainer "
                              f"(got {type(dataset).__name__})")
        self.dataset = dataset
        self._base = dataset.position  # the dataset stands at sample _base at step _base_step
        self._base_step = self._step = 0
        self._per_step = dataset.global_batch_size  # samples per optimizer step, set at train begin

    def state(self) -> dict[str, Any]:
        """What the Trainer saves with a checkpoint: the loader's state at the last step."""
        consumed = self._base + (self._step - self._base_step) * self._per_step
        return {"args": {}, "attributes": {"step": self._step,
                                           "loader": self.dataset.state_at(consumed)}}

    def on_init_end(self, args, state, control, **kwargs):
        """Turn off the Trainer's replay of the batches before a checkpoint (see the module)."""
        if args.restore_callback_states_from_checkpoint:
            raise ConfigError("restore_callback_states_from_checkpoint=True rebuilds callbacks "
                              "without their dataset; LoaderCallback restores itself: leave it "
                              "False")
        args.ignore_data_skip = True

    def on_train_begin(self, args, state, control, **kwargs):
        """Check the settings; on a resumed run, start the dataset at the checkpoint's state."""
        self._check(args)
        args.ignore_data_skip = True
        if state.global_step > 0:
            self.dataset.load_state_dict(self._saved(state))
        self._base, self._base_step = self.dataset.position, state.global_step
        self._step = state.global_step
        self._per_step = args.gradient_accumulation_steps * self.dataset.global_batch_size

    def on_step_end(self, args, state, control, **kwargs):
        """Count the optimizer step (the Trainer saves a checkpoint after this event)."""
        self._step = state.global_step

    def _check(self, args) -> None:
        if args.world_size != 1:
            raise ConfigError(f"LoaderCallback runs one training process (this Trainer has "
                              f"world_size={args.world_size}): accelerate would split the "
                              "TrainerDataset's batches again across processes")
        if args.per_device_train_batch_size != self.dataset.batch_size:
            raise ConfigError(f"per_device_train_batch_size={args.per_device_train_batch_size} "
                              f"but the Loader's batch_size is {self.dataset.batch_size}: set them "
                              "equal, so that each Trainer batch is one tokenmill batch")

    def _saved(self, state) -> Mapping[str, Any]:
        """The loader state the resumed checkpoint holds for this callback."""
        name = type(self).__name__
        saved = (state.stateful_callbacks or {}).get(name)
        if not isinstance(saved, Mapping) or "loader" not in saved.get("attributes", {}):
            raise ConfigError(f"the checkpoint of step {state.global_step} holds no tokenmill "
                              f"loader state (trainer_state.json has no {name!r} entry in "
                              "stateful_callbacks): it was saved without LoaderCallback; resume "
                              "from a checkpoint saved with it, or train from the start")
        attributes = saved["attributes"]
        if attributes.get("step") != state.global_step:
            raise ConfigError(f"the checkpoint's loader state is of step {attributes.get('step')}, "
                              f"its trainer state of step {state.global_step}; was "
                              "trainer_state.json edited?")
        return attributes["loader"]
