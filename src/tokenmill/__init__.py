"""tokenmill: raw text → token store → exact, resumable batches that keep accelerators fed."""

from tokenmill.errors import (ConfigError, InputError, StaleIterator, StoreError, TokenizerError,
                              TokenmillError)
from tokenmill.loader import Loader
from tokenmill.metrics import Instrumented, Meter, ModelCost
from tokenmill.prepare import PrepareConfig, prepare
from tokenmill.store import TokenStore, verify_store
from tokenmill.tokenizer import load_tokenizer
from tokenmill.watch import Watch

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
