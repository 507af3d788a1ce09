"""The public API: __all__ sorted, complete, and every name importable and documented."""

import inspect
import re
import subprocess
import sys
from pathlib import Path

import tokenmill


def test_all_is_sorted_and_complete():
    assert tokenmill.__all__ == sorted(tokenmill.__all__)
    public = {n for n in vars(tokenmill) if not n.startswith("_") and
              not inspect.ismodule(getattr(tokenmill, n))}
    assert public | {"__version__"} == set(tokenmill.__all__)


def test_every_public_name_has_a_docstring():
    for name in tokenmill.__all__:
        obj = getattr(tokenmill, name)
        if callable(obj):
            assert (obj.__doc__ or "").strip(), f"{name} has no docstring"


def test_every_import_line_the_docs_give_runs_in_a_fresh_interpreter():
    """README.md and docs/*.md tell users these paths (tokenmill.attention, tokenmill.tokenizer…);
    the folders under src/tokenmill may move, the paths may not."""
    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    lines = sorted({m.group(1) for page in pages for m in re.finditer(
        r"^\s*(from tokenmill[\w.]* import [^(\n]+|import tokenmill[\w.]*)$", page.read_text(), re.M)})
    assert "from tokenmill.attention import varlen_args" in lines
    done = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
