"""The token store: format, writer, reader, verification, remote cache and upload.

The names other modules used from ``tokenmill.store`` and ``tokenmill.remote`` are re-exported
here; code inside the package imports from the submodules, never from this facade.
"""

from tokenmill.base.io import (atomic_write_bytes, atomic_write_json, is_url, json_bytes, list_sizes,
                               no_space_is_a_store_error, parse_bytes, read_bytes, xxh3_file)
from tokenmill.store.cache import (CACHE_BYTES_ENV, CACHE_ENV, DEFAULT_CACHE_BYTES, CacheEntry,
                                   CacheFullError, DownloadCancelled, Pin, RemoteShards,
                                   ShardCache, default_cache_dir, url_key)
from tokenmill.store.format import (CODE_OF_DTYPE, DTYPE_CODES, FORMAT, IDX_HEADER, IDX_MAGIC,
                                    IDX_VERSION, MANIFEST, MANIFEST_CHECKSUM, VERSION, IdxArrays,
                                    build_manifest, check_shard_names, idx_bytes,
                                    manifest_checksum, parse_manifest, read_idx, read_manifest,
                                    shard_name, store_fingerprint)
from tokenmill.store.reader import MAX_OPEN, VERIFY_MODES, TokenStore, check_sizes
from tokenmill.store.upload import RemoteOut
from tokenmill.store.verify import verify_store
from tokenmill.store.writer import ShardInfo, ShardWriter

__all__ = [
    "CACHE_BYTES_ENV", "CACHE_ENV", "CODE_OF_DTYPE", "CacheEntry", "CacheFullError",
    "DEFAULT_CACHE_BYTES", "DTYPE_CODES", "DownloadCancelled", "FORMAT", "IDX_HEADER", "IDX_MAGIC",
    "IDX_VERSION", "IdxArrays", "MANIFEST", "MANIFEST_CHECKSUM", "MAX_OPEN", "Pin", "RemoteOut",
    "RemoteShards", "ShardCache", "ShardInfo", "ShardWriter", "TokenStore",
    "VERIFY_MODES", "VERSION",
    "atomic_write_bytes", "atomic_write_json", "build_manifest", "check_shard_names",
    "check_sizes", "default_cache_dir", "idx_bytes", "is_url", "json_bytes", "list_sizes",
    "manifest_checksum", "no_space_is_a_store_error", "parse_bytes", "parse_manifest",
    "read_bytes", "read_idx", "read_manifest", "shard_name", "store_fingerprint", "url_key",
    "verify_store", "xxh3_file",
]
