"""Integer settings (issue 22, class 6): one check for every int of the public API — numpy
integers of every width give exactly the batches, states and stores of the plain ints; bools,
floats and strings are refused showing the value; a seed past 64 bits is refused, never taken for
a smaller one."""

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import same, store_bytes, take, write_jsonl, write_positional_store
from tokenmill import Loader, prepare
from tokenmill.base.errors import ConfigError

L = 16
WIDTHS = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    lengths = np.random.default_rng(3).integers(1, 60, size=150)
    return write_positional_store(tmp_path_factory.mktemp("s") / "store", lengths, shard_tokens=2000)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    write_jsonl(root / "a.jsonl", [f"document {i}: " + "words and more words " * (i % 7 + 1)
                                   for i in range(120)])
    return root / "a.jsonl"


def batches_and_state(make, steps=3):
    """The first batches of ``make()`` and its state after them, through a JSON round trip (a
    numpy integer in the state would raise here, as it did for users)."""
    with make() as ld:
        got = take(ld, steps)
        state = ld.state_dict()
    return got, json.loads(json.dumps(state)), state


def plain(value):
    """Every value of a (nested) state is a plain JSON type: no numpy scalar hides in it."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(plain(v) for v in value)
    return value is None or type(value) in (int, float, str, bool)


LOADER_INTS = dict(seq_len=L, batch_size=2, seed=5, rank=1, world_size=2, num_workers=1,
                   prefetch=3, epochs=2)


@pytest.mark.parametrize("width", WIDTHS, ids=lambda w: w.__name__)
def test_numpy_integers_give_the_loaders_batches_and_state_of_plain_ints(store, width):
    want, want_state, _ = batches_and_state(lambda: Loader(store, **LOADER_INTS))
    given = {k: width(v) for k, v in LOADER_INTS.items()}
    got, got_state, raw = batches_and_state(lambda: Loader(store, **given))
    assert same(got, want) and got_state == want_state and plain(raw)
    packed = dict(seq_len=L, batch_size=2, layout="packed", max_segments=3, num_workers=0)
    want, want_state, _ = batches_and_state(lambda: Loader(store, **packed))
    got, got_state, raw = batches_and_state(lambda: Loader(store, **{
        k: width(v) if isinstance(v, int) else v for k, v in packed.items()}))
    assert same(got, want) and got_state == want_state and plain(raw)


@pytest.mark.parametrize("seed", [2**64, 2**64 + 5, 2**70, -1, np.int64(-1)])
def test_a_seed_past_64_bits_or_negative_is_refused_never_another_seed(store, text, tmp_path, seed):
    # 2**64 used to give seed 0's batches, 2**64 + 5 seed 5's: refused now, with the value shown
    shown = r"seed must be an int in \[0, 2\*\*64\) \(got seed="
    with pytest.raises(ConfigError, match=shown):
        Loader(store, seq_len=L, batch_size=2, seed=seed)
    with pytest.raises(ConfigError, match=shown):
        Loader.from_text([str(text)], seq_len=L, batch_size=2, seed=seed,
                         cache_dir=tmp_path / "cache")
    # the largest seed is one: it works and differs from seed 0
    top, _, _ = batches_and_state(lambda: Loader(store, seq_len=L, batch_size=2, seed=2**64 - 1))
    zero, _, _ = batches_and_state(lambda: Loader(store, seq_len=L, batch_size=2, seed=0))
    assert not same(top, zero)


@pytest.mark.parametrize("name,bad", [
    ("seed", True), ("seed", np.bool_(True)), ("seed", 5.0), ("seed", "5"),
    ("seq_len", np.bool_(True)), ("seq_len", 16.0), ("batch_size", True), ("batch_size", "2"),
    ("rank", True), ("world_size", np.float64(2)), ("num_workers", True), ("prefetch", True),
    ("epochs", 1.5), ("max_segments", True),
])
def test_bools_floats_and_strings_are_refused_showing_the_value(store, name, bad):
    kwargs = {**dict(seq_len=L, batch_size=2, rank=0, world_size=1), name: bad}
    if name == "max_segments":
        kwargs["layout"] = "packed"
    with pytest.raises(ConfigError) as e:
        Loader(store, **kwargs)
    message = str(e.value)
    assert f"{name} must be an int" in message and f"(got {name}={bad!r} of type " in message
    assert "\n" not in message


STREAM_INTS = dict(seq_len=L, batch_size=2, seed=7, shuffle_buffer=8, num_workers=0)


@pytest.mark.parametrize("layout", ["concat", "packed"])
def test_from_text_takes_numpy_integers_as_plain_ints(text, tmp_path, layout):
    extra = dict(layout=layout, max_segments=4, pack_window=4) if layout == "packed" else {}
    ints = {**STREAM_INTS, **extra}

    def make(given, cache):
        return lambda: Loader.from_text([str(text)], cache_dir=tmp_path / cache, **given)
    want, want_state, _ = batches_and_state(make(ints, "plain"))
    given = {k: np.uint16(v) if isinstance(v, int) else v for k, v in ints.items()}
    got, got_state, raw = batches_and_state(make(given, "numpy"))
    assert same(got, want) and got_state == want_state and plain(raw)


def test_prepare_takes_numpy_integers_and_writes_the_same_store(text, tmp_path):
    prepare([str(text)], out=tmp_path / "a", workers=1, progress=False, shard_tokens=3000,
            unit_bytes=4096)
    prepare([str(text)], out=tmp_path / "b", workers=np.int8(1), progress=False,
            shard_tokens=np.int64(3000), unit_bytes=np.uint32(4096))
    assert store_bytes(tmp_path / "a") == store_bytes(tmp_path / "b")
    with pytest.raises(ConfigError, match=r"shard_tokens must be an int >= 1 \(got shard_tokens=True"):
        prepare([str(text)], out=tmp_path / "c", progress=False, shard_tokens=True)



@pytest.mark.parametrize("width", [np.float16, np.float32, np.float64])
def test_prepare_takes_a_numpy_float_val_fraction_and_writes_the_same_split(text, tmp_path, width):
    """val_fraction=np.float32(0.25) (a value read from a numpy config) is the fraction 0.25:
    it was refused as "must be a number between 0 and 1"."""
    prepare([str(text)], out=tmp_path / "a", workers=1, progress=False, val_fraction=0.25)
    prepare([str(text)], out=tmp_path / "b", workers=1, progress=False,
            val_fraction=width(0.25))
    for side in ("train", "val"):
        assert store_bytes(tmp_path / "a" / side) == store_bytes(tmp_path / "b" / side)
    with pytest.raises(ConfigError, match=r"val_fraction must be a number between 0 and 1"):
        prepare([str(text)], out=tmp_path / "c", progress=False, val_fraction=np.bool_(True))

def test_the_command_line_refuses_a_seed_past_64_bits_in_one_line(store):
    done = subprocess.run([sys.executable, "-m", "tokenmill", "explain", str(store), "--seq-len",
                           str(L), "--batch-size", "2", "--step", "0", "--seed", str(2**64),
                           "--layout", "concat", "--world-size", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "tokenmill explain: error: seed must be an int in [0, 2**64) "
        "(got seed=18446744073709551616)"]
