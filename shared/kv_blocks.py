"""The one definition of a KV block's identity, shared by the engines (prefix cache, KV events) and the
router (which engine holds a prompt's prefix): chained hashes of full blocks of token ids.

    tokens  [t0 .. t15][t16 .. t31][t32 t33]     (block_size 16)
    hashes  h0 = H(root, t0..15)   h1 = H(h0, t16..31)   (the partial block has no hash)

Equal hashes mean equal prefixes (sha256). A `cache_salt` roots a chain of its own, so no other salt (or
none) can share its blocks; so does a LoRA adapter's name (its K/V differ from the base model's and from
other adapters'). On the wire (KV events) a block is named by the first 8 bytes of its hash: a collision there
can only make the router guess wrong, never make an engine reuse the wrong K/V.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = b"pagedserve-prefix-root"


def root_hash(cache_salt: str | None, lora_name: str | None = None) -> bytes:
    """The parent of a sequence's first block."""
    root = ROOT_HASH if not cache_salt else hashlib.sha256(ROOT_HASH + b"\0salt\0" + cache_salt.encode()).digest()
    return root if not lora_name else hashlib.sha256(root + b"\0lora\0" + lora_name.encode()).digest()


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    digest = hashlib.sha256(parent_hash)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None, lora_name: str | None = None
) -> list[bytes]:
    """The hashes of every full block of `token_ids`."""
    hashes: list[bytes] = []
    parent = root_hash(cache_salt, lora_name)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def wire_id(block_hash: bytes) -> int:
    """A block's name in KV events and the router's index (an unsigned 64-bit int: compact in msgpack)."""
    return int.from_bytes(block_hash[:8], "little")
