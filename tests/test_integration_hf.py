"""Hugging Face causal LMs on tokenmill batches: ``hf_inputs(batch)`` makes every packed token's
loss the one it gets when its document runs alone, for real ``transformers`` models built from
configs (nothing downloaded), and ``model(**hf_inputs(batch)).loss`` the mean over loss_mask."""

import os
import subprocess
import sys

import pytest
import torch
import transformers

from conftest import stdlib_lines_store
import tokenmill
from tokenmill.base.errors import ConfigError
from tokenmill.integrations.torch import flat_position_ids, hf_inputs, to_torch

VOCAB = 258  # the bytes tokenizer: 256 bytes, BOS, EOS
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
            "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
# sdpa exact to rounding; eager's softmax runs in fp32 even for an fp64 model (1e-8 seen)
TOLERANCE = {"sdpa": 1e-10, "eager": 1e-6}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The lines of three standard-library modules, one document each (bytes tokenizer)."""
    return stdlib_lines_store(tmp_path_factory.mktemp("hf"))


def first_batch(store, layout):
    loader = tokenmill.Loader(store, seq_len=128, batch_size=4, layout=layout, dtype="int32")
    with to_torch(loader) as batches:
        return {k: v.clone() for k, v in next(iter(batches)).items()}


@pytest.fixture(scope="module")
def packed(store):
    batch = first_batch(store, "packed")
    seg = batch["segment_ids"]
    assert (seg.max(dim=1).values >= 2).all() and (seg == 0).any()  # several documents, padding
    return batch


def model_of(family: str, attn: str):
    """A 2-layer model of ``family`` with random weights (seed 0), fp64, in eval mode."""
    config_name, model_name = FAMILIES[family]
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_implementation=attn)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).to(torch.float64).eval()


def token_losses(logits, targets):
    """-log p(target) of every position: logits (..., V), targets (...)."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1).long(),
                                             reduction="none").reshape(targets.shape)


def documents(batch):
    """(row, start, end) of every document segment of a packed batch (padding excluded)."""
    for b, row in enumerate(batch["segment_ids"]):
        for s in row.unique().tolist():
            if s:
                at = (row == s).nonzero().ravel()
                yield b, int(at[0]), int(at[-1]) + 1


def worst_gap(model, batch, packed_losses):
    """The largest |packed - alone| loss over the loss_mask tokens of every document."""
    worst = 0.0
    for b, a, z in documents(batch):
        with torch.no_grad():
            alone = token_losses(model(input_ids=batch["inputs"][b:b + 1, a:z].long()).logits[0],
                                 batch["targets"][b, a:z])
        keep = batch["loss_mask"][b, a:z].bool()
        worst = max([worst, *(packed_losses[b, a:z] - alone)[keep].abs().tolist()])
    return worst


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_losses_equal_documents_alone(packed, family, attn):
    model = model_of(family, attn)
    kwargs = hf_inputs(packed)
    with torch.no_grad():
        out = model(**kwargs)
    assert out.logits.shape[:2] == (1, packed["inputs"].numel())  # one flattened row
    shape = packed["targets"].shape
    losses = token_losses(out.logits[0], packed["targets"].flatten()).reshape(shape)
    assert worst_gap(model, packed, losses) <= TOLERANCE[attn]
    # HF's loss is the mean over tokenmill's loss_mask of -log p(target) (HF upcasts to fp32)
    mask = packed["loss_mask"].bool()
    assert out.loss.item() == pytest.approx(losses[mask].mean().item(), rel=1e-6)
    assert int((kwargs["shift_labels"] != -100).sum()) == int(mask.sum())


def test_labels_hold_the_targets_in_hf_form(packed):
    kwargs = hf_inputs(packed)
    want = packed["targets"].long().masked_fill(packed["loss_mask"] == 0, -100).reshape(1, -1)
    assert torch.equal(kwargs["shift_labels"], want)
    assert torch.equal(kwargs["labels"][:, 1:], want[:, :-1]) and kwargs["labels"][0, 0] == -100
    assert torch.equal(kwargs["position_ids"], flat_position_ids(packed).reshape(1, -1))
    assert kwargs["use_cache"] is False and kwargs["input_ids"].dtype == torch.int64


def test_the_formerly_documented_route_leaks(packed):
    """The old guide: flattened ids and position_ids, labels = masked targets, cache left on."""
    model = model_of("llama", "sdpa")
    ids, targets = packed["inputs"].reshape(1, -1).long(), packed["targets"].long()
    labels = targets.masked_fill(packed["loss_mask"] == 0, -100).reshape(1, -1)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=flat_position_ids(packed).reshape(1, -1),
                    labels=labels)
    losses = token_losses(out.logits[0], targets.flatten()).reshape(targets.shape)
    assert worst_gap(model, packed, losses) > 1e-3  # documents see the ones before them
    mask = packed["loss_mask"].bool()
    assert abs(out.loss.item() - losses[mask].mean().item()) > 1e-3  # labels one token too far


def test_concat_batch_gives_the_rows_as_they_are(store):
    batch = first_batch(store, "concat")
    kwargs = hf_inputs(batch)
    assert "position_ids" not in kwargs and kwargs["input_ids"].shape == batch["inputs"].shape
    assert torch.equal(kwargs["shift_labels"], batch["targets"].long())
    model = model_of("qwen2", "sdpa")
    with torch.no_grad():
        out = model(**kwargs)
    want = token_losses(out.logits, batch["targets"]).mean().item()
    assert out.loss.item() == pytest.approx(want, rel=1e-6)


def test_numpy_batches_of_the_loader_itself(store, packed):
    loader = tokenmill.Loader(store, seq_len=128, batch_size=4, layout="packed", dtype="int32")
    with loader:
        arrays = next(iter(loader))
        kwargs = hf_inputs(arrays)
        want = hf_inputs(packed)
        assert all(torch.equal(kwargs[k], want[k]) for k in want if k != "use_cache")


def test_a_batch_that_is_not_a_batch_is_refused():
    with pytest.raises(ConfigError, match="hf_inputs takes a batch of a tokenmill Loader"):
        hf_inputs(torch.zeros(2, 3))


def test_a_transformers_too_old_to_mask_packed_rows_is_refused(tmp_path):
    """transformers < 4.54 ignores packed position_ids in sdpa/eager: refused, saying so."""
    info = tmp_path / "transformers-4.53.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 4.53.3\n")
    code = ("import torch; from tokenmill.torch import hf_inputs\n"
            "hf_inputs({'inputs': torch.zeros(1, 2), 'targets': torch.zeros(1, 2)})")
    path = os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert "transformers 4.53.3 is installed" in last and "pip install 'transformers>=4.54'" in last
