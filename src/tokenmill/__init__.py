"""tokenmill: raw text → token store → exact, resumable batches that keep accelerators fed."""

import importlib

from tokenmill.errors import (ConfigError, InputError, StaleIterator, StoreError, TokenizerError,
                              TokenmillError)

# The rest is imported on first use (PEP 562): `tokenmill prepare` never needs the loader, whose
# imports cost ~0.1 CPU-s of every prepare's start-up.
_LAZY = {"Loader": "tokenmill.loader", "Instrumented": "tokenmill.metrics",
         "Meter": "tokenmill.metrics", "ModelCost": "tokenmill.metrics",
         "PrepareConfig": "tokenmill.prepare", "prepare": "tokenmill.prepare",
         "TokenStore": "tokenmill.store", "verify_store": "tokenmill.store",
         "load_tokenizer": "tokenmill.tokenizer", "Watch": "tokenmill.watch"}


def __getattr__(name: str):
    """The public names above, imported on first use."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "InputError",
    "Instrumented",
    "Loader",
    "Meter",
    "ModelCost",
    "PrepareConfig",
    "StaleIterator",
    "StoreError",
    "TokenStore",
    "TokenizerError",
    "TokenmillError",
    "Watch",
    "__version__",
    "load_tokenizer",
    "prepare",
    "verify_store",
]
