"""The command line: prepare → inspect → verify, exit codes and messages."""

import json
import subprocess
import sys

import pytest

from conftest import write_jsonl
from tokenmill.cli import main


def run(*args):
    return subprocess.run([sys.executable, "-m", "tokenmill", *args], capture_output=True, text=True)


@pytest.fixture()
def store(tmp_path, real_texts):
    write_jsonl(tmp_path / "c.jsonl", real_texts[:40])
    out = tmp_path / "store"
    assert main(["prepare", str(tmp_path / "c.jsonl"), "--out", str(out), "--workers", "1",
                 "--shard-tokens", "100000", "--quiet"]) == 0
    return out


def test_inspect_text_json_and_plot(store, tmp_path, real_texts, capsys):
    assert main(["inspect", str(store)]) == 0
    text = capsys.readouterr().out
    assert "documents    40" in text and "bytes" in text and "sample" in text
    assert main(["inspect", str(store), "--json", "--plot", str(tmp_path / "h.png")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["documents"] == 40
    assert info["tokens"] == sum(len(t.encode()) + 1 for t in real_texts[:40])
    assert info["sample"] == real_texts[0].encode()[:64].decode("utf-8", "replace")
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_verify_ok_then_flipped_byte_then_truncation(store):
    r = run("verify", str(store))
    assert r.returncode == 0 and "OK" in r.stdout
    shard = sorted(store.glob("shard-*.bin"))[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    r = run("verify", str(store))
    assert r.returncode == 1 and f"{shard.name}: checksum mismatch" in r.stdout
    idx = sorted(store.glob("shard-*.idx"))[0]
    idx.write_bytes(idx.read_bytes()[:-3])
    r = run("verify", str(store))
    assert r.returncode == 1 and f"{idx.name}: expected" in r.stdout


def test_prepare_bad_input_exit_code_and_message(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": \n')
    r = run("prepare", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "s"), "--workers", "1")
    assert r.returncode == 2
    assert "bad.jsonl:2: malformed JSON" in r.stderr and "--on-error skip" in r.stderr
    r = run("prepare", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "s"), "--workers", "1",
            "--on-error", "skip")
    assert r.returncode == 0 and "skipped 1 (malformed_json 1)" in r.stderr


def test_inspect_refuses_unfinished_store(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "shard-00000.bin").write_bytes(b"")
    r = run("inspect", str(tmp_path / "s"))
    assert r.returncode == 2 and "prepare did not finish" in r.stderr


def test_plan_prints_the_buffer_memory():
    r = run("plan", "--seq-len", "2048", "--batch-size", "8", "--prefetch", "2")
    # (2 prefetched + 2 held) × 8 rows × 2048 × (inputs + targets, int32) = 0.50 MiB
    assert r.returncode == 0 and "batch ring           0.50 MiB" in r.stdout


def test_bench_unknown_name_is_a_clear_error(store):
    r = run("bench", str(store), "--only", "nosuchloader")
    assert r.returncode == 2 and "nosuchloader" in r.stderr and "naive" in r.stderr
