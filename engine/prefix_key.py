"""Keys of cached KV blocks: what a full block holds is decided by its tokens, every token before it, and what
computed it (the adapter's name and content revision, or the base model; the request's cache salt).

A sequence's root key hashes that identity; block i's key hashes block i-1's key (the root for block 0) with
block i's tokens, so equal keys mean an equal prefix under an equal identity. Every part of the root is encoded
with a tag of its kind and its length, so a value of one kind never encodes like another kind's (an adapter
named like a salt, a salt that spells a name and a revision) and no two sequences of parts encode alike.
sha256 over that encoding: Python's hash() is salted per process and 64 bits wide.
"""

from __future__ import annotations

import hashlib
import struct

KEY_VERSION = b"kubelora-kv-block-1"
TAG_BASE = b"B"  # the base model computed it (no adapter)
TAG_ADAPTER = b"A"  # the adapter's name
TAG_REVISION = b"R"  # the adapter's content revision (a digest of its config and weights)
TAG_SALT = b"S"  # the request's cache_salt
TAG_BLOCK = b"T"  # a block: its parent's key, then its token ids


def root_key(adapter_name: str | None, adapter_revision: str | None, cache_salt: str | None) -> bytes:
    """The key every block chain of a sequence starts from. A base-model request has no adapter part; an adapter
    request needs both its name and its revision."""
    digest = hashlib.sha256(KEY_VERSION)
    if adapter_name is None:
        _update(digest, TAG_BASE, b"")
    else:
        if not adapter_revision:
            raise ValueError(f"adapter {adapter_name!r}: a cache key needs its content revision")
        _update(digest, TAG_ADAPTER, adapter_name.encode())
        _update(digest, TAG_REVISION, adapter_revision.encode())
    if cache_salt is not None:
        _update(digest, TAG_SALT, cache_salt.encode())
    return digest.digest()


def block_key(parent: bytes, token_ids: list[int]) -> bytes:
    """One full block's key: its parent's (32 bytes) and its token ids (8 bytes each, little-endian)."""
    digest = hashlib.sha256(KEY_VERSION)
    _update(digest, TAG_BLOCK, parent)
    _update(digest, TAG_BLOCK, struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def _update(digest, tag: bytes, value: bytes) -> None:
    digest.update(tag + struct.pack("<Q", len(value)) + value)
