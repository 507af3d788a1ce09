"""Coverage-guided fuzzing of the input readers with atheris (libFuzzer), in its own process.

    python atheris_readers.py WORKDIR CORPUS [libFuzzer flags, e.g. -runs=3000 -seed=1]

The first input byte picks the format, the second the policy, txt mode and unit size; the rest is
the file's content. Under on_error="raise" the only exception allowed is an InputError naming the
file and its place; under "skip" none at all. Anything else, or a hang, is a crash libFuzzer
reports (and this process exits non-zero).

atheris ships wheels for Linux x86_64; where it is not installed, the same harness runs on random
mutations of the corpus (byte flips, inserts, deletes, duplications, truncations) instead, and
says so ("engine: mutation").
"""

from __future__ import annotations

import os
import random
import re
import sys
import time

try:
    import atheris
except ImportError:
    atheris = None

if atheris is not None:
    with atheris.instrument_imports():
        from tokenmill.inputs import columnar, readers, records, sources  # noqa: F401  (instrumented too)
        from tokenmill.base.errors import InputError
else:
    from tokenmill.inputs import sources
    from tokenmill.base.errors import InputError

FORMATS = ["jsonl", "jsonl.gz", "jsonl.zst", "txt", "parquet", "arrow"]
WHERE = re.compile(r"line \d+|row \d+ \((row group|record batch) \d+\)|file")
WORKDIR = sys.argv[1]


def one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    fmt = FORMATS[data[0] % len(FORMATS)]
    policy = ("raise", "skip")[data[1] & 1]
    mode = ("file", "lines", "paragraphs")[(data[1] >> 1) % 3]
    unit = (1 << 20, 3, 17, 256)[(data[1] >> 3) & 3]
    path = os.path.join(WORKDIR, f"input.{fmt}")
    with open(path, "wb") as f:
        f.write(data[2:])
    config = sources.SourceConfig(on_error=policy, txt_mode=mode,
                                  unit_bytes=max(unit, len(data) // 200))
    try:
        units = sources.plan_units([path], config)  # compressed units: with their payloads, as prepare
        for unit_, payload in zip(units, sources.unit_payloads(units, 0, config)):
            for item in sources.read_unit(unit_, config, payload):
                if isinstance(item, sources.Skip):
                    assert item.path == path and WHERE.fullmatch(item.where), item
                else:
                    text = item.text
                    assert type(text) is str and text and text.encode("utf-8", "surrogatepass")
    except InputError as e:
        if policy == "skip" or e.path != path or not WHERE.fullmatch(e.where or ""):
            raise


def mutation_fuzz(corpus: str, flags: list[str]) -> None:
    """Without atheris: ``-runs`` random mutations of the corpus files through one_input."""
    opts = dict(f[1:].split("=", 1) for f in flags if f.startswith("-") and "=" in f)
    rng, runs = random.Random(int(opts.get("seed", 0))), int(opts.get("runs", 1000))
    seeds = []
    for name in sorted(os.listdir(corpus)):
        with open(os.path.join(corpus, name), "rb") as f:
            seeds.append(f.read())
    t0 = time.monotonic()
    for _ in range(runs):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(len(data) + 1)
            op = rng.randrange(5)
            if op == 0 and at < len(data):
                data[at] ^= rng.randrange(1, 256)
            elif op == 1:
                data[at:at] = rng.randbytes(rng.randint(1, 8))
            elif op == 2:
                del data[at:at + rng.randint(1, 16)]
            elif op == 3:
                data[at:at] = data[rng.randrange(len(data) + 1):][:rng.randint(1, 64)]
            else:
                del data[max(2, at):]
        one_input(bytes(data[:int(opts.get("max_len", 4096))]))
    print(f"engine: mutation\nDone {runs} runs in {time.monotonic() - t0:.0f} second(s)",
          file=sys.stderr)


if __name__ == "__main__":
    if atheris is None:
        mutation_fuzz(sys.argv[2], sys.argv[3:])
    else:
        atheris.Setup([sys.argv[0], *sys.argv[2:]], one_input)
        atheris.Fuzz()
