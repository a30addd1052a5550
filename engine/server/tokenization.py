"""Prompts to token ids, off the event loop: the engine's tokenizer, used on one worker thread.

The engine owns the tokenizer (`LLMEngine.tokenizer`, loaded once); its engine thread decodes with it while the
server encodes. Hugging Face tokenizers are not safe for concurrent use (a fast one refuses a borrow while another
call changes its truncation or padding; a slow one keeps Python caches), so the worker thread uses its own copy,
taken from the engine's when the server starts. Encoding and chat templating are CPU work that would stall every
open stream if they ran on the event loop.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor

from kubelora.engine.common.errors import InvalidRequest
from kubelora.engine.server.chat_template import TemplateOptions, render_text
from kubelora.engine.server.protocol import ChatMessage, Prompt


class PromptTokenizer:
    """`encode` and `render_chat` run on the `kubelora-tokenizer` thread; `close` stops it."""

    def __init__(self, engine_tokenizer) -> None:
        self._tokenizer = copy.deepcopy(engine_tokenizer)  # only ever used on `_thread`
        self._thread = ThreadPoolExecutor(1, "kubelora-tokenizer")
        self.vocab_size = len(engine_tokenizer)  # ids the tokenizer can decode (special tokens included)

    async def encode(self, prompts: tuple[Prompt, ...], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids per prompt; a prompt given as token ids is used as is."""
        return await self._run(self._encode_all, prompts, add_special_tokens)

    async def render_chat(self, messages: tuple[ChatMessage, ...], add_generation_prompt: bool,
                          options: TemplateOptions = TemplateOptions(), add_special_tokens: bool = False
                          ) -> list[int]:
        """The chat template's text, tokenized; a template that refuses the messages is the caller's error.
        add_special_tokens: the tokenizer's own (BOS) on top of the template's (vLLM's /tokenize option)."""
        return await self._run(self._render_chat, messages, add_generation_prompt, options, add_special_tokens)

    async def encode_words(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """`bad_words` as token sequences: each word as written and with a leading space (how it reads after
        another word), without special tokens; the same sequence once."""
        return await self._run(self._encode_words, words) if words else ()

    async def decode(self, token_ids: list[int]) -> str:
        """The text of token ids (an echoed prompt given as ids)."""
        return await self._run(self._tokenizer.decode, token_ids)

    async def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (vLLM's /tokenize `return_token_strs`)."""
        return await self._run(self._tokenizer.convert_ids_to_tokens, token_ids)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _encode_all(self, prompts: tuple[Prompt, ...], add_special_tokens: bool) -> list[list[int]]:
        return [list(p) if isinstance(p, tuple) else
                list(self._tokenizer.encode(p, add_special_tokens=add_special_tokens)) for p in prompts]

    def _render_chat(self, messages: tuple[ChatMessage, ...], add_generation_prompt: bool, options: TemplateOptions,
                     add_special_tokens: bool) -> list[int]:
        try:
            text = render_text(self._tokenizer, messages, add_generation_prompt, options)
        except Exception as exc:  # noqa: BLE001 - template errors (jinja raise_exception) are the caller's input
            raise InvalidRequest(f"'messages' cannot be rendered with the model's chat template: {exc}",
                                 param="messages", code="invalid_value") from None
        # The template writes special tokens (BOS) itself.
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _encode_words(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        variants = [v for w in words for v in (w.lstrip(), " " + w.lstrip())]
        encoded = (tuple(self._tokenizer.encode(v, add_special_tokens=False)) for v in variants)
        return tuple(dict.fromkeys(e for e in encoded if e))
