"""Paths → documents: ``walk`` (finding the files), ``sources`` (files, units, documents),
``records`` (what they share), ``splits``, ``textfields`` (which fields are the text), and one
reader per format (``readers``, ``jsonl``, ``tabular``, ``columnar``, ``decompress``)."""
