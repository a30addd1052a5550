"""A request's affinity key: which requests should land on the same replica, so that its prefix cache hits.

The router has no tokenizer, so it approximates the engine's block hashes as the Gateway API inference
extension's approximate prefix scorer does: by the text the prompt starts with. In order of precedence:

1. the `x-kubelora-conversation` header (a client that names its conversation);
2. the request's `user` field (one end user's turns);
3. the first `PREFIX_CHARS` characters of the first system message and of the first user message (a chat), or of
   the prompt (a completion). A conversation's later turns repeat both, so its turns share the key; two
   conversations under the same system prompt differ in their first user message and spread.

Every key also covers the model and the request's `cache_salt`: the engine never shares cached blocks across
adapters or salts, so neither may the key (two tenants with the same system prompt are two prefixes). Each part
is tagged with its kind before hashing, so no value of one kind can stand for another.

Pure: reads the payload the router already parsed for its model, and only the messages up to the first user
message (a long history costs nothing).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

CONVERSATION_HEADER = "x-kubelora-conversation"
# Characters of the system message and of the first user message that the key covers: a few hundred tokens, about
# GIE's default block size times a few blocks. Enough to tell two conversations apart; the hash costs microseconds.
PREFIX_CHARS = 1024
# Token ids of a completion prompt given as ids (the same span as PREFIX_CHARS, at about 4 characters a token).
PREFIX_TOKEN_IDS = PREFIX_CHARS // 4
_SYSTEM_ROLES = ("system", "developer")


def affinity_key(model: str, payload: Mapping, headers: Mapping[str, str]) -> str | None:
    """The key to place this request by among the replicas that may serve it; None when the request carries
    nothing to key on (the router then keys on the model alone)."""
    salt = payload.get("cache_salt")
    scope = ["model", model, "salt", salt if isinstance(salt, str) else ""]
    conversation = headers.get(CONVERSATION_HEADER)
    if conversation:
        return _digest([*scope, "conversation", conversation])
    user = payload.get("user")
    if isinstance(user, str) and user:
        return _digest([*scope, "user", user])
    prefix = _prefix(payload)
    return _digest([*scope, "prefix", *prefix]) if prefix is not None else None


def _digest(parts: list[str]) -> str:
    # JSON of the list: every part is delimited and escaped, so ("a", "bc") and ("ab", "c") differ.
    return hashlib.blake2b(json.dumps(parts).encode(), digest_size=16).hexdigest()


def _prefix(payload: Mapping) -> list[str] | None:
    messages = payload.get("messages")
    if isinstance(messages, list):
        return _chat_prefix(messages)
    return _completion_prefix(payload.get("prompt"))


def _chat_prefix(messages: list) -> list[str] | None:
    """["system", first system text, "user", first user text], up to the first user message."""
    system = None
    for message in messages:
        if not isinstance(message, Mapping):
            return None
        role = message.get("role")
        if role in _SYSTEM_ROLES and system is None:
            system = _text(message.get("content"))
        elif role == "user":
            return ["system", system or "", "user", _text(message.get("content"))]
    return ["system", system] if system is not None else None


def _text(content) -> str:
    """The first PREFIX_CHARS characters of a message's content: a string, or OpenAI content parts whose text
    parts count in order (an image part counts as its type, so two images are not one prefix with none)."""
    if isinstance(content, str):
        return content[:PREFIX_CHARS]
    if not isinstance(content, list):
        return ""
    text = ""
    for part in content:
        if len(text) >= PREFIX_CHARS:
            break
        if isinstance(part, Mapping):
            piece = part.get("text") if part.get("type") == "text" else f"<{part.get('type')}>"
            text += piece if isinstance(piece, str) else ""
    return text[:PREFIX_CHARS]


def _completion_prefix(prompt) -> list[str] | None:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of prompts: its first one
    if isinstance(prompt, str) and prompt:
        return ["text", prompt[:PREFIX_CHARS]]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt[:PREFIX_TOKEN_IDS]):
        return ["ids", ",".join(map(str, prompt[:PREFIX_TOKEN_IDS]))]
    return None
