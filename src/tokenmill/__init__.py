"""tokenmill: raw text → token store → exact, resumable batches that keep accelerators fed."""

import sys

from tokenmill.base.errors import (ConfigError, InputError, StaleIterator, StoreError, TokenizerError,
                                   TokenmillError)
from tokenmill.load import attention
from tokenmill.load.loader import Loader
from tokenmill.observe.metrics import Instrumented, Meter, ModelCost
from tokenmill.prepare import PrepareConfig, prepare
from tokenmill.store import TokenStore, verify_store
from tokenmill.tokenizer import load_tokenizer
from tokenmill.observe.watch import Watch

__version__ = "0.1.0"

# `from tokenmill.load.attention import varlen_args`, the path the guides give, names load/attention.py
sys.modules[f"{__name__}.attention"] = attention

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
