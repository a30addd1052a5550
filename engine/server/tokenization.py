"""Prompts to token ids, off the event loop: the engine's tokenizer, used on one worker thread.

The engine owns the tokenizer (`LLMEngine.tokenizer`, loaded once); its engine thread decodes with it while the
server encodes. Hugging Face tokenizers are not safe for concurrent use (a fast one refuses a borrow while another
call changes its truncation or padding; a slow one keeps Python caches), so the worker thread uses its own copy,
taken from the engine's when the server starts. Encoding and chat templating are CPU work that would stall every
open stream if they ran on the event loop.

Before any of that, a text is measured against a bound that needs no tokenizing: no token covers more than
`max_token_chars` characters (the longest entry of the vocabulary, special tokens included), so a text longer
than `MAX_CHARS_SLACK * max_token_chars * max_model_len` characters cannot fit max-model-len and is refused at
once (a 15 MiB prompt would otherwise cost the worker thread tens of seconds and the process gigabytes). The
bound assumes every character reaches the tokenizer's model, as in byte-level BPE and SentencePiece
tokenizers; the slack covers normalizers such as NFC, which may compose up to four characters into one.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor

from kubelora.contract.errors import InvalidRequest, PromptTooLong
from kubelora.engine.server.chat_template import TemplateOptions, num_template_chars, render_text
from kubelora.engine.server.protocol import ChatMessage, Prompt

MAX_CHARS_SLACK = 4


class PromptTokenizer:
    """`encode` and `render_chat` run on the `kubelora-tokenizer` thread; `close` stops it."""

    def __init__(self, engine_tokenizer, max_model_len: int) -> None:
        self._tokenizer = copy.deepcopy(engine_tokenizer)  # only ever used on `_thread`
        self._thread = ThreadPoolExecutor(1, "kubelora-tokenizer")
        self.vocab_size = len(engine_tokenizer)  # ids the tokenizer can decode (special tokens included)
        self._max_model_len = max_model_len
        max_token_chars = max(len(token) for token in engine_tokenizer.get_vocab())
        self.max_chars = MAX_CHARS_SLACK * max_token_chars * max_model_len

    async def encode(self, prompts: tuple[Prompt, ...], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids per prompt; a prompt given as token ids is used as is."""
        for prompt in prompts:
            if isinstance(prompt, str):
                self._check_chars(len(prompt), "prompt")
            elif len(prompt) >= self._max_model_len:  # before copying millions of ids on the worker thread
                raise PromptTooLong(len(prompt), self._max_model_len, param="prompt")
        return await self._run(self._encode_all, prompts, add_special_tokens)

    async def render_chat(self, messages: tuple[ChatMessage, ...], add_generation_prompt: bool,
                          options: TemplateOptions = TemplateOptions(), add_special_tokens: bool = False
                          ) -> list[int]:
        """The chat template's text, tokenized; a template that refuses the messages is the caller's error.
        add_special_tokens: the tokenizer's own (BOS) on top of the template's (vLLM's /tokenize option)."""
        # The template writes every message (and the tools, the kwargs) into its text, plus its own markup.
        self._check_chars(num_template_chars(messages, options), "messages")
        return await self._run(self._render_chat, messages, add_generation_prompt, options, add_special_tokens)

    def _check_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_chars:
            raise PromptTooLong(None, self._max_model_len, param=param, message=(
                f"'{param}' has {num_chars} characters; max_model_len is {self._max_model_len} tokens, which no "
                f"text of more than {self.max_chars} characters fits with this tokenizer"))

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
