"""Tokenizers: ``kinds`` (one protocol, four kinds, ``load_tokenizer``), ``files`` (which file a
spec means), ``fastbpe`` (the proven fast engines of a byte-level BPE)."""

from tokenmill.tokenizer.kinds import Tokenizer, encode_documents, load_tokenizer, token_dtype, train_bpe

__all__ = ["Tokenizer", "encode_documents", "load_tokenizer", "token_dtype", "train_bpe"]
