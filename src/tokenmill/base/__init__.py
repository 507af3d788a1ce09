"""What every folder stands on: ``errors``, ``io`` (URLs, atomic writes, memory maps, checksums,
locks), ``procs`` and ``child`` (worker processes), ``arrays`` (small numpy helpers)."""
