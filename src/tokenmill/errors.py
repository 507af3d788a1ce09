"""Errors tokenmill raises on purpose: each names the file, line or shard and says what to do."""

from __future__ import annotations


class TokenmillError(Exception):
    """Base class of every error tokenmill raises on purpose."""


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


class ConfigError(TokenmillError, ValueError):
    """A setting is out of range or inconsistent; the message shows the bad value."""


class TokenizerError(TokenmillError):
    """A tokenizer spec cannot be loaded, or lacks what tokenmill needs (e.g. an EOS id)."""
