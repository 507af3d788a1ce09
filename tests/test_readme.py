"""The README's first example, saved as example.py in an empty folder and run with
``python example.py``, works and prints what it claims (issue 12: no ``if __name__ ==
"__main__":`` guard, so worker processes must never re-run the user's main module)."""

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_example() -> str:
    """The first ```python block of README.md."""
    return re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)


def test_readme_example_runs_as_a_script(tmp_path):
    code = readme_example()
    assert "__main__" not in code  # the point: a plain script, as a user saves it
    (tmp_path / "example.py").write_text(code)
    r = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-4000:]
    out = r.stdout
    assert "step 100 |" in out and "tok/s" in out and "data wait" in out
    assert "'consumed_samples': 2400" in out
    state = re.findall(r"^\{'version': 1, 'consumed_samples': 2400, 'fingerprint': '[0-9a-f]+', "
                       r"'stream': \{'stores': \[\['store', '[0-9a-f]+'\]\].*\}\}$",
                       out, re.M)
    assert len(state) == 1, out  # the state dict, printed once, as the comment says
    assert (tmp_path / "store" / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "corpus.jsonl", "example.py", "store"]  # it wrote only what it says, where it runs


def test_preparing_real_corpora_guide_runs_as_a_script(tmp_path):
    """docs/preparing.md: tokenizers by name, .json/.csv, splits, a transform, a validation
    split, explain and streaming mixtures — its python blocks run offline as one script."""
    from conftest import run_guide
    done = run_guide("preparing.md", tmp_path)
    assert done.stdout.strip().endswith("ok")
