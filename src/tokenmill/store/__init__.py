"""The token store: format, writer, reader, verification, remote cache and upload.

The names other code uses from ``tokenmill.store`` are re-exported here; code inside the package
imports from the submodules, never from this facade.
"""

from tokenmill.store.format import (CODE_OF_DTYPE, DTYPE_CODES, IDX_HEADER, IDX_MAGIC, IDX_VERSION,
                                    MANIFEST, build_manifest, idx_bytes, manifest_checksum,
                                    read_idx, read_manifest, shard_name, store_fingerprint)
from tokenmill.store.reader import TokenStore
from tokenmill.store.verify import verify_store
from tokenmill.store.writer import ShardInfo, ShardWriter

__all__ = [
    "CODE_OF_DTYPE", "DTYPE_CODES", "IDX_HEADER", "IDX_MAGIC", "IDX_VERSION", "MANIFEST",
    "ShardInfo", "ShardWriter", "TokenStore", "build_manifest", "idx_bytes", "manifest_checksum",
    "read_idx", "read_manifest", "shard_name", "store_fingerprint", "verify_store",
]
