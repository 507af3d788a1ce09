"""docs/guide-nanogpt.md: the diff that swaps nanoGPT's get_batch for the Loader runs, in a fresh
interpreter, against a split store made by `tokenmill prepare --val-fraction`, with the globals
nanoGPT's train.py defines before it (data_dir, block_size, batch_size, device)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import write_jsonl

pytest.importorskip("torch")

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide-nanogpt.md"


def diff_hunks() -> list[str]:
    """The added lines of each hunk of the guide's ```diff block, in order."""
    diff = re.search(r"```diff\n(.*?)```", GUIDE.read_text(), re.S).group(1)
    hunks = re.split(r"^@@.*@@\n", diff, flags=re.M)[1:]
    return ["\n".join(line[1:] for line in h.splitlines() if line.startswith("+")) for h in hunks]


# hunks: get_batch, the vocabulary, the checkpoint dict's item, the resume statement
SCRIPT = r'''
import json, sys, textwrap
import numpy as np, torch, tokenmill
get_batch_code, vocab_code, ckpt_item, resume_code = json.loads(open(sys.argv[2]).read())
nanogpt = dict(os=__import__("os"), np=np, torch=torch, data_dir=sys.argv[1], block_size=16,
               batch_size=4, device="cpu")

def train_py():
    """A namespace as train.py has it after the diff's top-level hunks."""
    ns = dict(nanogpt)
    exec(get_batch_code, ns)
    exec(vocab_code, ns)
    return ns

ns = train_py()
assert ns["meta_vocab_size"] == 258, ns["meta_vocab_size"]  # the bytes tokenizer, not 50,304
plan = {s: tokenmill.Loader(f"{sys.argv[1]}/{s}", seq_len=16, batch_size=4, seed=1337)
        for s in ("train", "val")}
stream = {s: np.concatenate([d for d in tokenmill.TokenStore(f"{sys.argv[1]}/{s}")])
          for s in ("train", "val")}

def check(x, y, split, k):
    """x, y: batch k of split's pure plan, int64 (4, 16), each row the store's own tokens."""
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    want = plan[split].batch_at(4 * k)
    assert (x.numpy() == want["inputs"]).all() and (y.numpy() == want["targets"]).all()
    for xi, yi in zip(x.numpy(), y.numpy()):
        row = np.concatenate([xi, yi[-1:]])
        starts = np.flatnonzero(stream[split][:-16] == row[0])
        assert any((stream[split][s:s + 17] == row).all() for s in starts)
        assert (xi[1:] == yi[:-1]).all()

X, Y = ns["get_batch"]("train")
check(X, Y, "train", 0)
with torch.no_grad():  # estimate_loss: its own streams
    for _ in range(3):
        check(*ns["get_batch"]("train"), "train", _)
        check(*ns["get_batch"]("val"), "val", _)
X, Y = ns["get_batch"]("train")
check(X, Y, "train", 1)  # evaluating took nothing from the training stream
X, Y = ns["get_batch"]("train")
checkpoint = eval("{" + ckpt_item + "}", ns)  # taken with batch 2 in hand
assert checkpoint["data"]["consumed_samples"] == 8

ns = train_py()  # a resume: a fresh train.py
exec(textwrap.dedent(resume_code), {**ns, "checkpoint": checkpoint})
X2, Y2 = ns["get_batch"]("train")
check(X2, Y2, "train", 2)
assert torch.equal(X2, X) and torch.equal(Y2, Y)
check(*ns["get_batch"]("train"), "train", 3)
print("ok")
'''


def test_the_guides_get_batch_swap_runs_and_resumes_exactly(tmp_path):
    hunks = diff_hunks()
    assert len(hunks) == 4 and "def get_batch(split):" in hunks[0]
    texts = [f"document {i}: " + "lorem ipsum dolor " * (i % 9 + 1) for i in range(300)]
    write_jsonl(tmp_path / "c.jsonl", texts)
    r = subprocess.run([sys.executable, "-m", "tokenmill", "prepare", str(tmp_path / "c.jsonl"),
                        "--out", str(tmp_path / "mydata"), "--tokenizer", "bytes",
                        "--val-fraction", "0.2", "--workers", "1"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (tmp_path / "hunks.json").write_text(json.dumps(hunks))
    (tmp_path / "check.py").write_text(SCRIPT)
    r = subprocess.run([sys.executable, "check.py", str(tmp_path / "mydata"), "hunks.json"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-4000:]
