"""Shared fixtures and helpers: small real-text corpora, self-describing stores, comparing stores
byte for byte, and taking, comparing and resuming batch streams (every test uses these, none
keeps its own copy)."""

import itertools
import json
import os
import sysconfig
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def stdlib_texts(limit_bytes: int, pattern: str = "*.py") -> list[str]:
    """Real text: the Python standard library's own sources, in sorted order, up to a size."""
    texts, total = [], 0
    for p in sorted(STDLIB.glob(pattern)):
        try:
            t = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not t:
            continue
        texts.append(t)
        total += len(t)
        if total >= limit_bytes:
            break
    return texts


def write_jsonl(path: Path, texts) -> Path:
    """One {"text": …} object per line."""
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return path


def stdlib_lines_store(tmp: Path, modules=("textwrap.py", "shlex.py", "glob.py")) -> str:
    """A store at ``tmp/store`` of the non-blank lines of standard-library modules, one document
    each (bytes tokenizer); its path."""
    import tokenmill
    lines = [line for name in modules
             for line in (STDLIB / name).read_text(encoding="utf-8").splitlines() if line.strip()]
    tokenmill.prepare(str(write_jsonl(tmp / "p.jsonl", lines)), out=str(tmp / "store"),
                      tokenizer="bytes", workers=1)
    return str(tmp / "store")


def store_bytes(path: Path) -> dict[str, bytes]:
    """Every file of a store (hidden ones too), by name: equal dicts mean byte-identical stores."""
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir()) if p.is_file()}


@pytest.fixture(scope="session")
def real_texts() -> list[str]:
    """About 1.5 MB of real text (stdlib sources)."""
    return stdlib_texts(1_500_000)


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory, real_texts) -> str:
    """A byte-level BPE tokenizer.json (vocab 2,000) trained on real text, path as a string."""
    from tokenmill.tokenizer import train_bpe
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return str(train_bpe(real_texts[:200], 2000, out_path=out))


def write_positional_store(path: Path, lengths, *, shard_tokens: int = 1 << 30, offset: int = 0):
    """A store (int32) whose token at global position p is offset + p: any reorder, drop or
    duplicate of tokens shows up as a broken arithmetic sequence."""
    import numpy as np
    total = int(np.sum(lengths))
    return write_token_store(path, np.arange(offset, offset + total), lengths,
                             shard_tokens=shard_tokens)


MIX_NAMES = ("web", "code", "math")
MIX_OFFSET = 1_000_000  # store i's tokens are i·MIX_OFFSET + position: a row names its store
MIX_PHASES = [(0, {"web": 0.9, "code": 0.1}), (40, {"web": 0.6, "code": 0.3, "math": 0.1}),
              (100, {"code": 0.5, "math": 0.5})]
MIX_EDITS = {  # edits of MIX_PHASES' future: the first sample each one changes, the phases
    "reweigh": (100, MIX_PHASES[:2] + [(100, {"web": 1.0})]),
    "move": (100, MIX_PHASES[:2] + [(120, MIX_PHASES[2][1])]),
    "add": (200, MIX_PHASES + [(200, {"web": 0.2, "math": 0.8})]),
}


def mixture_stores(root: Path) -> dict[str, str]:
    """Three positional stores by name (``MIX_NAMES``, tokens offset by ``MIX_OFFSET`` a store)
    of about 86, 36 and 24 concat samples of seq_len 8: a mixture of them (``MIX_PHASES``)
    crosses phases and epochs within a few dozen steps of 4 samples."""
    sizes = {"web": 700, "code": 300, "math": 200}
    return {n: str(write_positional_store(
        root / n, lengths_summing_to(sizes[n], docs=sizes[n] // 12, longest=20, seed=i),
        offset=i * MIX_OFFSET)) for i, n in enumerate(MIX_NAMES)}


def mixture_loader(stores, *, mixture=MIX_PHASES, layout="concat", rank=0, world_size=1):
    """A Loader over ``mixture_stores`` with ``mixture`` phases: seq_len 8, seed 7, a global batch
    of 4 samples split over ``world_size`` ranks, batches assembled inline."""
    from tokenmill import Loader
    return Loader(stores, seq_len=8, batch_size=4 // world_size, layout=layout, seed=7,
                  rank=rank, world_size=world_size, num_workers=0, mixture=mixture)


def mixture_batches(stores, steps=60, **kw) -> list[dict]:
    """The first ``steps`` batches of a ``mixture_loader`` (60: all three phases of
    ``MIX_PHASES``, and more than one epoch of "code" and "math")."""
    with mixture_loader(stores, **kw) as ld:
        return take(ld, steps)


def write_sparse_store(out: Path, shard_lengths: list) -> Path:
    """A store of uint16 zeros, one shard per array of document lengths, its .bin files sparse
    (no blocks written) and checksums placeholders: open it with verify="off"."""
    import numpy as np

    from tokenmill.base.io import atomic_write_json
    from tokenmill.store import ShardInfo, build_manifest, idx_bytes, shard_name
    out.mkdir(parents=True)
    infos = []
    for i, lengths in enumerate(shard_lengths):
        name, tokens = shard_name(i), int(np.sum(lengths))
        with open(out / f"{name}.bin", "wb") as f:
            f.truncate(2 * tokens)
        (out / f"{name}.idx").write_bytes(idx_bytes(np.asarray(lengths, np.int64), np.uint16))
        infos.append(ShardInfo(name, len(lengths), tokens, 2 * tokens,
                               (out / f"{name}.idx").stat().st_size, f"{i:016x}", f"{i:016x}"))
    manifest = build_manifest(tokenizer={"kind": "sparse-test", "vocab_size": 65000},
                              dtype=np.uint16, shards=infos, settings={}, skipped={"total": 0})
    atomic_write_json(out / "manifest.json", manifest)
    return out


def write_token_store(path: Path, tokens, lengths, *, shard_tokens: int = 1 << 30):
    """A store (int32) of ``tokens`` cut into documents of ``lengths``, shards of about
    ``shard_tokens`` tokens."""
    import numpy as np
    from tokenmill.base.io import atomic_write_json
    from tokenmill.store import ShardWriter, build_manifest
    path.mkdir(parents=True, exist_ok=True)
    lengths = np.asarray(lengths, dtype=np.int64)
    tokens = np.asarray(tokens, dtype=np.int32)
    assert len(tokens) == int(lengths.sum())
    w = ShardWriter(path, dtype=np.int32, shard_tokens=shard_tokens)
    shards = [info for info, _ in w.add(tokens, lengths)]
    if (last := w.finish()) is not None:
        shards.append(last)
    # one "tokenizer" for every offset: positional stores may be mixed
    manifest = build_manifest(tokenizer={"kind": "positional", "vocab_size": 1 << 31},
                              dtype=np.int32, shards=shards,
                              settings={}, skipped={"total": 0})
    atomic_write_json(path / "manifest.json", manifest)
    return path


def run_prepare(cwd: Path, *args):
    """``python -m tokenmill prepare ARGS --workers 1`` in ``cwd``, as a user runs it."""
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "tokenmill", "prepare", *map(str, args),
                           "--workers", "1"], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)


def byte_texts(store) -> list[str]:
    """The documents of a bytes-tokenizer store, decoded (ids < 256, the EOS dropped)."""
    return [bytes(d[:-1]).decode() for d in docs_of(store)]


def read_log(path: Path) -> list[dict]:
    """A program's JSON-lines event log; a torn last line (a kill mid-write) is dropped."""
    events = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return events


def lengths_summing_to(total: int, *, docs: int, longest: int, seed: int):
    """``docs`` random document lengths in [1, longest), the last one stretched so that they
    sum to exactly ``total`` tokens (e.g. (n + 1)·seq_len: exactly n concat samples)."""
    import numpy as np
    lengths = np.random.default_rng(seed).integers(1, longest, size=docs)
    lengths[-1] += total - lengths.sum()
    assert lengths[-1] > 0, f"{docs} documents of up to {longest} tokens exceed {total}"
    return lengths


def docs_of(path) -> list[list[int]]:
    """Every document of the store at ``path``, as lists of token ids."""
    from tokenmill.store import TokenStore
    with TokenStore(path) as s:
        return [s[i].tolist() for i in range(len(s))]


def run_guide(name: str, tmp_path: Path, *, drop_env: tuple[str, ...] = ()):
    """Run the python blocks of docs/``name``, in order, as one script ``guide.py`` in the empty
    directory ``tmp_path`` (a fresh interpreter, offline); it must exit 0. Its finished process."""
    import re
    import subprocess
    import sys
    guide = Path(__file__).resolve().parents[1] / "docs" / name
    code = "\n".join(re.findall(r"```python\n(.*?)```", guide.read_text(), re.S))
    assert code, f"docs/{name} has no python block"
    (tmp_path / "guide.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run([sys.executable, "guide.py"], cwd=tmp_path, env=env, timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


# ---- tokenizers (built here, nothing from the network) ----------------------------------

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
MULTILINGUAL = [
    "The quick brown fox doesn't jump; it's 3.14 times lazier than 1,000 dogs.\n",
    "Ça va très bien, merci ! Straße, naïve café, façade, Åsa och Örjan.\n",
    "日本語のテキストと中文文本、そして한국어 텍스트.\n",
    "Привет, мир! Γειά σου κόσμε. مرحبا بالعالم. नमस्ते दुनिया।\n",
    "emoji 😀👍🏽 👨‍👩‍👧 🇫🇷 ✨\n",
    "    for i in range(10):\n        print(i ** 2)  # squares\n\n\n",
]
FRAGMENTS = ["<|endoftext|>", " ", "  ", "   ", "\n", "\n\n", "\r\n", "\t", "'s", "'S", "'ll",
             "don't", "1234567", "3.14", "😀", "👨‍👩‍👧", "日本", "e\u0301", "\u00a0", "\u3000",
             "def f(x):\n    return x\n", "Ġ", "<|endoftext", "|>", "<|endoftext|><|endoftext|>"]


def training_texts() -> list[str]:
    """Real text to train on: a few stdlib modules' sources plus some multilingual lines."""
    names = ["textwrap.py", "string.py", "shlex.py", "fnmatch.py", "bisect.py", "heapq.py"]
    return [(STDLIB / n).read_text(encoding="utf-8") for n in names] + MULTILINGUAL * 20


@pytest.fixture(scope="session")
def gpt2_json(tmp_path_factory) -> str:
    """A GPT-2-style byte-level BPE (vocab 800) trained by train_bpe."""
    from tokenmill.tokenizer import train_bpe
    path = tmp_path_factory.mktemp("gpt2") / "tokenizer.json"
    return train_bpe(training_texts(), 800, out_path=path)


@pytest.fixture(scope="session")
def llama3_json(tmp_path_factory) -> str:
    """A Llama-3-style BPE: Split(regex, isolated) then ByteLevel(use_regex=False), ignore_merges."""
    from tokenizers import Regex, Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(training_texts(), trainers.BpeTrainer(
        vocab_size=700, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    config = json.loads(tok.to_str())
    config["model"]["ignore_merges"] = True  # as in Meta's file
    path = tmp_path_factory.mktemp("llama3") / "tokenizer.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return str(path)


def edited(src: str, dst: Path, edit) -> str:
    """A copy of tokenizer.json `src` at `dst` with `edit(config)` applied."""
    config = json.loads(Path(src).read_text(encoding="utf-8"))
    edit(config)
    dst.write_text(json.dumps(config), encoding="utf-8")
    return str(dst)


def ids_of(tok, texts):
    """Every text's ids, as lists."""
    return [x.tolist() for x in tok.encode_batch(texts)]


# ---- pytest-xdist: `make test` runs the suite in two worker processes ----------------------

RELAYED_FIGURES: list[str] = []  # the xdist workers whose fault figures reached the controller


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller of an xdist run: a worker's fault figures (tests/faults) join its own."""
    if relayed := getattr(node, "workeroutput", {}).get("fault_figures"):
        from faults.conftest import merge
        merge(relayed)
        RELAYED_FIGURES.append(node.gateway.id)


def pytest_terminal_summary(terminalreporter):
    """Under xdist, the controller prints the fault figures its workers relayed, unless
    faults/conftest.py is one of its own plugins (run as ``pytest tests/faults``) and does."""
    from faults import conftest
    if RELAYED_FIGURES and not terminalreporter.config.pluginmanager.is_registered(conftest):
        conftest.pytest_terminal_summary(terminalreporter)


# ---- a local S3 server (moto) ------------------------------------------------------------

@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on 127.0.0.1 for the whole session, stopped at the end."""
    import logging

    import moto.server as moto_server
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


class S3:
    """One fresh bucket; AWS_* variables point at the local server only while the test runs."""

    def __init__(self, endpoint: str, bucket: str):
        import s3fs
        self.endpoint, self.bucket = endpoint, bucket
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True)
        self.fs.mkdir(bucket)

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def put_dir(self, local: Path, key: str) -> str:
        for p in sorted(local.iterdir()):
            if p.is_file():
                self.fs.put_file(str(p), f"{self.bucket}/{key}/{p.name}")
        return self.url(key)

    def objects(self, key: str) -> dict[str, bytes]:
        self.fs.invalidate_cache()
        return {Path(p).name: self.fs.cat_file(p) for p in self.fs.ls(f"{self.bucket}/{key}")}


@pytest.fixture
def s3(s3_endpoint, monkeypatch, tmp_path):
    """A fresh bucket on the session's moto server, AWS_* set for this test only."""
    import uuid
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "default-cache"))
    return S3(s3_endpoint, f"t-{uuid.uuid4().hex[:12]}")


# ---- batch streams ----------------------------------------------------------------------------

def kill_after_first_commit(proc, out: Path) -> None:
    """kill -9 a running prepare into ``out`` once it has committed a shard (not yet finished)."""
    import time
    deadline = time.monotonic() + 60
    while not list((out / ".progress").glob("shard-*.json")) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    proc.kill()
    proc.wait()
    assert not (out / "manifest.json").exists(), "finished before the kill: grow the corpus"


def take(batches, n: int | None = None) -> list[dict]:
    """The next ``n`` batches (all, if None) of an iterable, every array copied to numpy: a loader
    may reuse its buffers once we let go of a batch (torch/jax arrays are copied too)."""
    return [{k: _numpy_copy(v) for k, v in b.items()} for b in itertools.islice(batches, n)]


def _numpy_copy(a):
    import numpy as np
    return np.array(a.numpy() if hasattr(a, "numpy") else a)  # torch: .numpy() (CPU) first


def same(got: list[dict], want: list[dict]) -> bool:
    """Equal lists of batches: the same keys and exactly equal arrays, batch by batch."""
    import numpy as np
    return len(got) == len(want) and all(
        g.keys() == w.keys() and all(np.array_equal(np.asarray(g[k]), np.asarray(w[k])) for k in w)
        for g, w in zip(got, want))


def run_ranks(open_rank, world: int, state: dict | None, steps: int) -> tuple[list, int, dict]:
    """Every rank r < ``world`` (``open_rank(r)``: a fresh loader), resumed from ``state`` (None:
    from the start), takes ``steps`` batches: (each rank's batches, the sample they started at,
    the state after, through JSON as a checkpoint keeps it). For elastic-resume tests."""
    got = []
    for r in range(world):
        with open_rank(r) as ld:
            if state is not None:
                ld.load_state_dict(state)
            start = ld.consumed_samples
            got.append(take(ld, steps))
            saved = json.loads(json.dumps(ld.state_dict()))
    return got, start, saved


def assert_resumes_exactly(make, steps: int) -> None:
    """Resume at every step k from a JSON round trip of the state, in a fresh loader from
    ``make()``: the tail equals the uninterrupted run's. Used for every stateful thing."""
    with make() as ref_loader:
        ref = take(ref_loader, steps)
    for k in range(steps + 1):
        with make() as a:
            take(a, k)
            state = json.loads(json.dumps(a.state_dict()))
        with make() as b:
            b.load_state_dict(state)
            assert same(take(b, steps - k), ref[k:]), f"resume at step {k} diverged"


def assert_worker_death_is_an_error(batches, workers, *, budget: int):
    """SIGKILL the worker processes ``workers`` (psutil); the iterator ``batches`` then raises a
    RuntimeError saying a worker died — never a hang, never a quiet end — at the latest once it
    has handed out ``budget`` batches more: those made ahead before the kill (a count, not a
    clock: a busy machine makes the same batches, only later)."""
    import signal

    import pytest
    for w in workers:
        w.send_signal(signal.SIGKILL)
    with pytest.raises(RuntimeError, match="died") as e:
        for _ in range(budget + 1):
            next(batches)
    return e.value


class OnTerminal:
    """A command whose stderr is a terminal (a pty of 24 × 100), as a user's: prepare shows its
    progress bar there. ``until(pattern)`` reads what it wrote up to a match; ``finish()`` waits
    for the exit and returns everything it wrote."""

    def __init__(self, cmd, env=None):
        import fcntl
        import struct
        import subprocess
        import termios
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=slave)
        os.close(slave)
        self.seen = ""

    def until(self, pattern: str, timeout: float = 300) -> str:
        """Everything written so far, once ``pattern`` (a regex) shows in it."""
        import re
        import select
        import time
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.seen):
            assert self.proc.poll() is None, f"ended before {pattern!r}:\n{self.seen[-2000:]}"
            assert time.monotonic() < deadline, \
                f"no {pattern!r} in {timeout} s:\n{self.seen[-2000:]}"
            if select.select([self.master], [], [], 0.5)[0]:
                self._drain()
        return self.seen

    def finish(self, timeout: float = 120) -> str:
        """Wait for the command to end (killed if it has not within ``timeout``); all it wrote."""
        try:
            self.proc.wait(timeout=timeout)
            self._drain()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            os.close(self.master)
        return self.seen

    def lines(self) -> list[str]:
        """What it wrote, as the lines a terminal shows (a bar's redraws each a line)."""
        import re
        return [ln.strip() for ln in re.split(r"[\r\n]+", self.seen) if ln.strip()]

    def _drain(self) -> None:
        import select
        while select.select([self.master], [], [], 0.2)[0]:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every writer has closed its side
                return
            if not chunk:
                return
            self.seen += chunk.decode(errors="replace")


HOLD_MODULE = '''import os, time

def text(record):
    """The record's text; a record marked "hold" waits until the file $TM_GO exists."""
    while record.get("hold") and not os.path.exists(os.environ["TM_GO"]):
        time.sleep(0.02)
    return record["text"]
'''


def held_corpus(root: Path, texts: list[str], files: int = 12) -> tuple[Path, dict[str, str]]:
    """``files`` JSONL inputs under ``root/corpus``, the last one's records marked "hold", and the
    environment of a run with ``--transform holdtext:text``: its last unit waits until the file
    ``env["TM_GO"]`` exists, so a run is surely still working once its progress has moved."""
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(files):
        with open(corpus / f"part-{i:02d}.jsonl", "w", encoding="utf-8") as f:
            for t in texts[i::files]:
                f.write(json.dumps({"text": t, "hold": i == files - 1}) + "\n")
    (root / "holdtext.py").write_text(HOLD_MODULE)
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return corpus, {**os.environ, "PYTHONPATH": path, "TM_GO": str(root / "go")}
