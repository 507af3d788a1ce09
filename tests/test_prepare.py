"""prepare: formats end to end, worker-count independence, resume after SIGKILL, bad input."""

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from conftest import store_bytes, write_jsonl
from tokenmill.errors import ConfigError, InputError
from tokenmill.prepare import prepare
from tokenmill.store import TokenStore, verify_store

EOS = 256


def byte_ids(text: str) -> list[int]:
    """What the built-in byte tokenizer stores for a document: UTF-8 bytes, then EOS."""
    return list(text.encode("utf-8")) + [EOS]


def docs_of(path) -> list[list[int]]:
    with TokenStore(path) as s:
        return [s[i].tolist() for i in range(len(s))]


def test_every_format_round_trips_exactly(tmp_path):
    texts = ["héllo wörld", "second doc\nwith two lines", "日本語のテキスト", "emoji 🎉 done"]
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "a.jsonl", texts[:2])
    with gzip.open(src / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": texts[2]}) + "\n")
    (src / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        (json.dumps({"text": texts[3]}) + "\n").encode()))
    pq.write_table(pa.table({"text": texts + ["tail"]}), src / "d.parquet", row_group_size=2)
    (src / "e.txt").write_text("a whole file\n\nas one document\n", encoding="utf-8")
    m = prepare([str(src)], out=tmp_path / "store", workers=1, progress=False)
    want = texts[:2] + [texts[2], texts[3]] + texts + ["tail"] + ["a whole file\n\nas one document\n"]
    assert docs_of(tmp_path / "store") == [byte_ids(t) for t in want]
    assert m["num_documents"] == len(want) and m["skipped"]["total"] == 0
    assert verify_store(tmp_path / "store") == []


@pytest.mark.parametrize("mode,want", [
    ("lines", ["one", "two", "three"]),
    ("paragraphs", ["one\ntwo", "three"]),
])
def test_txt_modes(tmp_path, mode, want):
    (tmp_path / "t.txt").write_text("one\ntwo\n\nthree\n")
    m = prepare([str(tmp_path / "t.txt")], out=tmp_path / "s", txt_mode=mode, workers=1,
                progress=False)
    assert docs_of(tmp_path / "s") == [byte_ids(t) for t in want]
    if mode == "lines":
        assert m["skipped"]["by_reason"] == {"empty_document": 1}


def test_byte_identical_for_any_worker_count(tmp_path, real_texts, bpe_tokenizer):
    write_jsonl(tmp_path / "corpus.jsonl", real_texts)
    stores = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        prepare([str(tmp_path / "corpus.jsonl")], out=out, tokenizer=bpe_tokenizer,
                workers=workers, shard_tokens=40_000, unit_bytes=64_000, progress=False)
        stores.append(store_bytes(out))
    assert len(stores[0]) > 6  # several shards, so boundaries are exercised
    assert stores[0] == stores[1]


def test_fast_and_slow_tokenizer_engines_write_identical_stores(tmp_path, real_texts, bpe_tokenizer):
    write_jsonl(tmp_path / "c.jsonl", real_texts[:60])
    for fast in (True, False):
        prepare([str(tmp_path / "c.jsonl")], out=tmp_path / f"f{fast}", tokenizer=bpe_tokenizer,
                workers=1, fast_tokenizer=fast, progress=False)
    assert store_bytes(tmp_path / "fTrue") == store_bytes(tmp_path / "fFalse")


def _prepare_cmd(inputs, out, tokenizer):
    return [sys.executable, "-m", "tokenmill", "prepare", *inputs, "--out", str(out),
            "--tokenizer", tokenizer, "--workers", "2", "--shard-tokens", "30000", "--quiet"]


def test_resume_after_sigkill_is_byte_identical(tmp_path, real_texts, bpe_tokenizer):
    import psutil
    corpus = write_jsonl(tmp_path / "corpus.jsonl", real_texts * 3)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    ref = tmp_path / "ref"
    t0 = time.monotonic()
    subprocess.run(_prepare_cmd([str(corpus)], ref, bpe_tokenizer), check=True, env=env)
    duration = time.monotonic() - t0
    rng = random.Random(1234)
    interrupted = 0
    for trial in range(3):
        out = tmp_path / f"run{trial}"
        proc = subprocess.Popen(_prepare_cmd([str(corpus)], out, bpe_tokenizer), env=env)
        time.sleep(rng.uniform(0.15, 0.9) * duration)
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        interrupted += not (out / "manifest.json").exists()
        # the workers notice their parent is gone and exit by themselves
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, f"orphan workers after SIGKILL: {alive}"
        subprocess.run(_prepare_cmd([str(corpus)], out, bpe_tokenizer), check=True, env=env)
        assert store_bytes(out) == store_bytes(ref)
    assert interrupted >= 2, "the kills landed after prepare finished; the test proved nothing"


def test_rerun_of_finished_store_is_a_no_op_and_other_settings_are_refused(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", ["abc", "def"])
    out = tmp_path / "s"
    prepare([str(tmp_path / "c.jsonl")], out=out, workers=1, progress=False)
    before = store_bytes(out)
    prepare([str(tmp_path / "c.jsonl")], out=out, workers=1, progress=False)
    assert store_bytes(out) == before
    with pytest.raises(ConfigError, match="other settings"):
        prepare([str(tmp_path / "c.jsonl")], out=out, workers=1, progress=False, shard_tokens=7)
    prepare([str(tmp_path / "c.jsonl")], out=out, workers=1, progress=False, shard_tokens=7,
            overwrite=True)
    assert len(TokenStore(out).manifest["shards"]) == 1


BAD_CASES = {
    # name: (file name, content bytes, reason, where-fragment)
    "malformed_json": ("a.jsonl", b'{"text": "ok"}\n{"text": broken\n', "malformed_json", ":2"),
    "missing_field": ("a.jsonl", b'{"text": "ok"}\n{"body": "x"}\n', "missing_field", ":2"),
    "non_string_field": ("a.jsonl", b'{"text": "ok"}\n{"text": 42}\n', "non_string_field", ":2"),
    "invalid_utf8": ("a.jsonl", b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', "invalid_utf8", ":2"),
    "binary_file": ("a.txt", b"ok" + bytes(100), "binary_file", "a.txt"),
    "empty_file": ("a.jsonl", b"", "empty_file", "a.jsonl"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_raise_names_file_and_line(tmp_path, case):
    name, content, reason, where = BAD_CASES[case]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / name).write_bytes(content)
    write_jsonl(tmp_path / "in" / "good.jsonl", ["fine"])
    with pytest.raises(InputError) as e:
        prepare([str(tmp_path / "in")], out=tmp_path / "s", workers=1, progress=False)
    assert name in str(e.value) and where in str(e.value)
    assert e.value.reason == reason
    assert not (tmp_path / "s" / "manifest.json").exists()


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_skip_counts_and_keeps_the_rest(tmp_path, case):
    name, content, reason, _ = BAD_CASES[case]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / name).write_bytes(content)
    write_jsonl(tmp_path / "in" / "good.jsonl", ["fine"])
    m = prepare([str(tmp_path / "in")], out=tmp_path / "s", workers=1, progress=False,
                on_error="skip")
    assert m["skipped"]["by_reason"] == {reason: 1}
    assert m["skipped"]["examples"][0]["path"].endswith(name)
    kept = [byte_ids("ok")] if content.startswith(b'{"text": "ok"}') else []
    kept += [byte_ids("fine")] if name != "good.jsonl" else []
    assert docs_of(tmp_path / "s")[-len(kept):] == kept and len(docs_of(tmp_path / "s")) == len(kept)


def test_no_match_and_nothing_left(tmp_path):
    with pytest.raises(InputError, match="nothing-here"):
        prepare([str(tmp_path / "nothing-here*.jsonl")], out=tmp_path / "s", workers=1,
                progress=False)
    write_jsonl(tmp_path / "only-empty.jsonl", ["", ""])
    with pytest.raises(InputError, match="no documents"):
        prepare([str(tmp_path / "only-empty.jsonl")], out=tmp_path / "s2", workers=1,
                progress=False)
    assert not (tmp_path / "s2" / "manifest.json").exists()


def test_unreadable_file(tmp_path):
    if os.geteuid() == 0:
        # root reads anything: a directory named like an input file is unreadable as a file
        (tmp_path / "x.jsonl").mkdir()
        bad = tmp_path / "x.jsonl"
    else:
        bad = write_jsonl(tmp_path / "x.jsonl", ["a"])
        bad.chmod(0)
    with pytest.raises(InputError):
        prepare([str(bad)], out=tmp_path / "s", workers=1, progress=False)


def test_tokenizer_kinds_through_prepare(tmp_path, real_texts, bpe_tokenizer):
    from tokenmill.tokenizer import load_tokenizer
    write_jsonl(tmp_path / "c.jsonl", real_texts[:5])
    prepare([str(tmp_path / "c.jsonl")], out=tmp_path / "hf", tokenizer=bpe_tokenizer, workers=1,
            progress=False)
    tok = load_tokenizer(bpe_tokenizer)
    with TokenStore(tmp_path / "hf") as s:
        assert s.dtype == np.uint16
        assert s.tokenizer == tok.identity()
        for i, text in enumerate(real_texts[:5]):
            assert s[i].tolist() == tok.encode_batch([text])[0].tolist() + [tok.eos_id]
