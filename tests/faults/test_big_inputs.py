"""Big inputs: one huge compressed file or document must not be held in memory whole.

Failure class: a multi-GB ``.jsonl.zst`` shard (the common form of public corpora) read as one
unit — held whole, tokenized as one piece, peak RSS ~5x its text, no parallelism inside it — and
a huge line or ``.txt`` document that ends in a raw ``MemoryError``.

A compressed input is made from real text (the Python standard library's sources, repeated, each
document naming its position), planned into many units by one streaming pass, and read as prepare
reads it (``unit_payloads`` + ``read_unit``) by a separate process (``read_big_input.py``) that
reports its peak RSS. Quick size: 300 MB of text; soak: 3 GB.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import xxhash
import zstandard

from faults.conftest import SIZE_NAME, child_env, record

HERE = Path(__file__).resolve().parent
TEXT_BYTES = {"quick": 300 << 20, "soak": 3 << 30}[SIZE_NAME]
UNIT_BYTES = 4 << 20  # prepare's default
RSS_LIMIT = 200 << 20  # for 300 MB of text (quick) as for 3 GB (soak): it must not grow with the input


def stdlib_texts() -> list[str]:
    """The standard library's .py sources, sorted by path (tens of MB of real text)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for p in sorted(root.rglob("*.py")):
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return [t for t in texts if t.strip()]


def write_corpus(path: Path, text_bytes: int, open_out) -> tuple[int, str, int, int]:
    """A .jsonl of about text_bytes, document i = f"[{i}] " + a stdlib source file, compressed by
    ``open_out``; returns the documents' (count, digest) as read_big_input.py computes them, the
    JSONL's size and its longest line."""
    bodies = [(t.encode(), json.dumps(t).encode()[1:]) for t in stdlib_texts()]
    longest = max(len(e) for _, e in bodies) + 40
    h, n, size = xxhash.xxh3_64(), 0, 0
    with open_out(path) as out:
        while size < text_bytes:
            raw, escaped = bodies[n % len(bodies)]
            tag = b"[%d] " % n
            line = b'{"text": "' + tag + escaped + b"}\n"
            out.write(line)
            h.update(tag + raw)
            h.update(b"\xff")
            n, size = n + 1, size + len(line)
    return n, h.hexdigest(), size, longest


def zst_writer(path: Path):
    return zstandard.ZstdCompressor(level=1).stream_writer(open(path, "wb"), closefd=True)


def gz_writer(path: Path):
    return gzip.open(path, "wb", compresslevel=1)


def read_in_child(path: Path, tmp: Path, *args, **env) -> dict:
    out = subprocess.run([sys.executable, str(HERE / "read_big_input.py"), str(path), *map(str, args)],
                         env=child_env(tmp, **env), capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("suffix,writer,share", [(".zst", zst_writer, 1), (".gz", gz_writer, 3)])
def test_a_big_compressed_input_is_read_in_bounded_units_exactly(tmp_path, suffix, writer, share):
    """(share: the gzip file is a third of the size: gzip is slower to write and read.)"""
    path = tmp_path / f"big.jsonl{suffix}"
    count, digest, size, longest = write_corpus(path, TEXT_BYTES // share, writer)
    compressed = path.stat().st_size
    got = read_in_child(path, tmp_path / "tmp", UNIT_BYTES)
    path.unlink()
    assert got["decompressed_bytes"] == size
    assert 20 < got["units"] <= size // UNIT_BYTES + 1  # many units of at least UNIT_BYTES each,
    assert got["max_unit"] < UNIT_BYTES + longest  # and at most one document more
    assert got["shipped"] == got["whole"] == [count, digest]  # every document once, in order
    assert got["alone_equal"] == [True, True]  # a worker without the payload reads the same
    assert got["peak_rss"] < RSS_LIMIT, f"peak RSS {got['peak_rss'] >> 20} MiB for {size >> 20} MiB of text"
    record(f"big compressed input ({suffix[1:]})", text_mib=size >> 20, compressed_mib=compressed >> 20,
           units=got["units"], peak_rss_mib=got["peak_rss"] >> 20,
           plan_mib_per_s=round(size / got["plan_s"] / 2**20))


def write_huge_line(path: Path, open_out, first: bytes, last: bytes) -> None:
    """first, a 384 MiB line of "x", last."""
    block = b"x" * (16 << 20)
    with open_out(path) as f:
        f.write(first)
        for _ in range(24):
            f.write(block)
        f.write(last)


@pytest.mark.parametrize("name,mode", [("huge.txt", "lines"), ("huge.txt", "paragraphs"),
                                       ("huge.jsonl.zst", "file")])
def test_a_line_too_long_for_memory_is_an_input_error_naming_file_and_line(tmp_path, name, mode):
    path = tmp_path / name
    if name.endswith(".zst"):
        write_huge_line(path, zst_writer, b'{"text": "short"}\n{"text": "', b'"}\n{"text": "last"}\n')
    else:
        write_huge_line(path, lambda p: open(p, "wb"), b"short line\n", b"\nlast line\n")
    got = read_in_child(path, tmp_path / "tmp", 1 << 20, mode, MEMORY_LIMIT_MB="192")
    assert got["error"].startswith(f"{path}:2: line 2 is too long to hold in memory (MemoryError)"), got
    assert (got["where"], got["path"], got["reason"]) == ("line 2", str(path), "unreadable")
    record("line too long for memory", line_mib=384, memory_cap_mib=192)


def test_a_txt_too_big_for_memory_in_file_mode_is_an_input_error(tmp_path):
    path = tmp_path / "huge.txt"
    write_huge_line(path, lambda p: open(p, "wb"), b"short line\n", b"\nlast line\n")
    got = read_in_child(path, tmp_path / "tmp", 1 << 20, "file", MEMORY_LIMIT_MB="192")
    assert got["error"].startswith(f"{path}: the file is one document (txt_mode='file') too big"), got
    assert (got["where"], got["path"]) == ("file", str(path))
