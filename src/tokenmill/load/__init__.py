"""Store → batches: the sampler, the layouts (``pack``, ``packplan``, ``packfit``, ``segments``,
``attention``), the pure ``plan`` and its ``rows``, balanced rows across ranks (``balance``,
``balanced``, ``cpsplit``, ``seqlens``), the ``Loader`` and its workers, resume state,
provenance, device prefetch.

Nothing is imported here. ``streaming`` stands on load's modules; ``Loader.from_text``, which
opens a stream, is wired by the public face (``tokenmill/__init__.py``).
"""
