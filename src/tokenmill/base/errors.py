"""Errors tokenmill raises on purpose: each names the file, line or shard and says what to do.

The command line prints any of them as one line, ``tokenmill <command>: error: <message>``, and
exits 2; the Python API raises them with the same text.
"""

from __future__ import annotations

import numbers
import os
import re
import reprlib


# scheme://user:password@ — the password is whatever sits between the first ':' and the '@'
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^\s/@:'\"]*):(?P<pw>[^\s/@'\"]*)@")
# ?token=… &key=… &X-Amz-Signature=… &sig=…: query parameters that carry secrets; the value ends
# where the URL does in a message: at whitespace, & # quotes ( ) , ; ] > or a ':' ending a phrase
_SECRET_QUERY = re.compile(
    r"(?P<head>[?&;][\w.\-]*(?:token|key|secret|passw(?:or)?d|pwd|sig|signature|credential|auth)"
    r"[\w.\-]*=)(?P<value>(?:[^&#\s'\"(),;\]>:]|:(?!\s|$))+)", re.IGNORECASE)


def redact(text: str | os.PathLike) -> str:
    """``text`` with the password and secret query values of every URL in it replaced by ``***``.

    redact("fetch http://ann:pw@host/a?token=t&x=1 failed")
        == "fetch http://ann:***@host/a?token=***&x=1 failed"
    """
    text = os.fspath(text) if not isinstance(text, str) else text
    if "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(r"\g<head>:***@", text)
    return _SECRET_QUERY.sub(r"\g<head>***", text)


class TokenmillError(Exception):
    """Base class of every error tokenmill raises on purpose; its message has credentials
    redacted."""

    def __init__(self, message: object = "", *args: object):
        super().__init__(redact(str(message)), *args)


class InputError(TokenmillError):
    """A source file is missing, unreadable or malformed; the message names file and line/row."""

    def __init__(self, message: str, *, path: str | None = None, where: str | None = None,
                 reason: str | None = None):
        super().__init__(message)
        self.path = path
        self.where = where
        self.reason = reason


class StoreError(TokenmillError):
    """A token store is incomplete, of the wrong version, or does not match its manifest."""


class ConcurrentWriterError(StoreError):
    """Another process is writing the same output (it holds its lock); names the path and pid."""

    def __init__(self, message: str, *, path: str | None = None, pid: int | None = None):
        super().__init__(message)
        self.path = path
        self.pid = pid


class DiskFullError(StoreError):
    """Writing a file failed: the disk is full (or a quota or file-size limit is reached); the
    message names the file and says to free space and run again. ``path``, ``reason``: for a
    writer that knows better what to advise (a streaming cache names its cache_dir)."""

    def __init__(self, message: str, *, path: str | None = None, reason: str | None = None):
        super().__init__(message)
        self.path = path
        self.reason = reason


class ConfigError(TokenmillError, ValueError):
    """A setting is out of range or inconsistent; the message shows the bad value."""


class TokenizerError(TokenmillError):
    """A tokenizer spec cannot be loaded, or lacks what tokenmill needs (e.g. an EOS id)."""


class StaleIterator(TokenmillError, RuntimeError):
    """An iterator of a loader (``Loader`` or the streaming loader) that was iterated again,
    loaded or closed after it was made: it raises this at its next ``next()``, never ending
    quietly. (A RuntimeError too, as it was before it had a type.)"""


class WorkerError(TokenmillError, RuntimeError):
    """A worker process died or cannot start; the message gives its real exit reason and the
    last lines of its stderr. (A RuntimeError too, as worker deaths were before.)"""


class Terminated(SystemExit):
    """SIGTERM, raised in the main thread where cleanup still runs (``procs.sigterm_exits``);
    uncaught, the process exits 143 (128 + SIGTERM) as if the signal had ended it."""

    def __init__(self):
        super().__init__(128 + 15)


def os_error_text(error: OSError) -> str:
    """One line for an OSError: the file(s) it names, then what the system said.

    os_error_text(NotADirectoryError(20, "Not a directory", "out/x")) == "out/x: Not a directory"
    """
    what = error.strerror or str(error) or type(error).__name__
    names = [os.fsdecode(f) for f in (error.filename, error.filename2) if f is not None]
    return f"{' -> '.join(names)}: {what}" if names else what


def is_int(value: object) -> bool:
    """True for an integer of any kind — a Python int or a numpy integer of any width — and
    False for bool, numpy bool, float, str and the rest.

    is_int(3) and is_int(np.uint32(3)) and not is_int(True) and not is_int(3.0)
    """
    # np.integer of every width registers as Integral; np.bool_ does not
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: object, *, minimum: int, maximum: int | None = None,
              optional: bool = False, or_else: str | None = None) -> int | None:
    """``value`` as a plain Python int when it is an integer (numpy of any width too) in
    [minimum, maximum] — or None when ``optional`` and it is None; else a one-line ConfigError
    naming ``name`` and showing the value. ``or_else`` only words the message: what else the
    caller accepts (e.g. "'auto'").

    type(check_int("seq_len", np.int16(64), minimum=1)) is int
    """
    if optional and value is None:
        return None
    if is_int(value) and value >= minimum and (maximum is None or value <= maximum):
        return int(value)
    if maximum is None:
        bound = f">= {minimum}"
    elif (maximum + 1) & maximum == 0 and maximum >= 1 << 16:  # 2**64 - 1: "[0, 2**64)"
        bound = f"in [{minimum}, 2**{maximum.bit_length()})"
    elif maximum & (maximum - 1) == 0 and maximum >= 1 << 16:  # 2**62: "[1, 2**62]"
        bound = f"in [{minimum}, 2**{maximum.bit_length() - 1}]"
    else:
        bound = f"in [{minimum}, {maximum}]"
    also = "".join(f" or {x}" for x in (or_else, "None" if optional else None) if x)
    kind = "" if is_int(value) else f" of type {type(value).__name__}"
    raise ConfigError(f"{name} must be an int {bound}{also} (got {name}={reprlib.repr(value)}{kind})")


def require(module: str, extra: str, what: str):
    """``module`` imported, or a ConfigError: ``what`` needs it, and the extra that installs it.

    require("json", "x", "y").dumps(1) == "1"
    """
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{what} needs {module.split('.')[0]}, not installed: pip install "
                          f"'tokenmill[{extra}]'") from None
