"""Seeing the data path: ``metrics`` (``Meter``), ``watch`` (``Watch``), ``inspection`` (what
``tokenmill inspect`` shows), ``bench`` (loaders side by side)."""
