"""Read one big input as prepare does, in its own process, and print what it measured as JSON.

    [MEMORY_LIMIT_MB=N] python read_big_input.py PATH UNIT_BYTES [TXT_MODE]

Plans the file into units (timed: the planning pass), reads every unit with the payload the
parent would ship (``unit_payloads``), then the whole file as one unit, and reads two units
alone (as a worker without a payload). Prints the documents' count and xxh3 digest for each way,
the number of units, the planning pass's time and the peak RSS of this process (VmHWM). An InputError is
printed as {"error": message, "where": ...} (exit 0): the caller checks it. MEMORY_LIMIT_MB caps
the address space at N MiB above what the process maps after its imports (RLIMIT_AS).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import xxhash

from tokenmill.inputs import sources
from tokenmill.base.errors import InputError


def digest(docs) -> tuple[int, str]:
    """(count, xxh3-64 of every document and a separator): exact equality, bounded memory."""
    h, n = xxhash.xxh3_64(), 0
    for d in docs:
        assert isinstance(d, sources.Doc), d
        h.update(d.text.encode())
        h.update(b"\xff")  # never in UTF-8: documents cannot run together
        n += 1
    return n, h.hexdigest()


def main(path: str, unit_bytes: int, txt_mode: str = "file") -> dict:
    config = sources.SourceConfig(unit_bytes=unit_bytes, txt_mode=txt_mode)
    t0 = time.perf_counter()
    units = sources.plan_units([path], config)
    plan_s = time.perf_counter() - t0
    shipped = digest(d for u, b in zip(units, sources.unit_payloads(units, 0, config))
                     for d in sources.read_unit(u, config, b))
    whole = digest(sources.read_unit(sources.Unit(path, 0, -1), config))
    some = [len(units) // 2, len(units) - 1]
    payloads = [b for i, b in enumerate(sources.unit_payloads(units, some[0], config))
                if i + some[0] in some]
    alone = [digest(sources.read_unit(units[i], config)) == digest(sources.read_unit(units[i], config, b))
             for i, b in zip(some, payloads)]
    return {"units": len(units), "decompressed_bytes": units[-1].stop, "plan_s": plan_s,
            "max_unit": max(u.stop - u.start for u in units),
            "shipped": shipped, "whole": whole, "alone_equal": alone,
            "peak_rss": peak_rss()}


def peak_rss() -> int:
    """This process's peak RSS in bytes: VmHWM (ru_maxrss would count the parent's RSS at fork)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def limit_memory(extra_mb: int) -> None:
    """Cap the address space at what is mapped now plus extra_mb MiB."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = vm + (extra_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


if __name__ == "__main__":
    if "MEMORY_LIMIT_MB" in os.environ:
        import zstandard  # noqa: F401  (mapped before the cap, as a long-running prepare has it)
        limit_memory(int(os.environ["MEMORY_LIMIT_MB"]))
    try:
        out = main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
    except InputError as e:
        out = {"error": str(e), "where": e.where, "reason": e.reason, "path": e.path}
    print(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)
