"""A slim install (issue 26): without an extra, what needs it is a one-line error naming the
extra — a real `tokenmill prepare` process in which pyarrow / zstandard cannot be imported."""

import os
import subprocess
import sys

BLOCK = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("pyarrow", "zstandard", "sentencepiece"):
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, Block())
"""


def test_a_missing_extra_is_a_one_line_error_naming_it(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCK)  # as if `pip install tokenmill` alone
    (tmp_path / "a.parquet").write_bytes(b"PAR1 not read")
    (tmp_path / "b.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd not read")
    (tmp_path / "c.jsonl").write_text('{"text": "core formats need no extra"}\n')
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}

    def prepare(name):
        return subprocess.run([sys.executable, "-m", "tokenmill", "prepare", name, "--out",
                               f"s-{name}", "--workers", "1"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    r = prepare("c.jsonl")
    assert r.returncode == 0, r.stderr
    for name, extra in (("a.parquet", "parquet"), ("b.jsonl.zst", "zstd")):
        r = prepare(name)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"not installed: pip install 'tokenmill[{extra}]'" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
