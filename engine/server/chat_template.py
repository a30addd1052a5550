"""What a chat request hands the model's chat template besides its messages: tools, `continue_final_message`,
`chat_template_kwargs` (vLLM's names), and the rendering itself (called on the tokenizer thread).

`continue_final_message` renders the last (assistant) message open, without its end-of-turn markup and without a
generation prompt, so the model continues it; vLLM refuses it together with `add_generation_prompt`, and so do
we. `chat_template_kwargs` become template variables (e.g. Qwen 3's `enable_thinking`); names the server sets
itself are refused. A request's own `chat_template` is refused: a template is code the server would run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kubelora.contract.errors import InvalidRequest
from kubelora.engine.server.fields import Fields
from kubelora.engine.server.tools import ToolRequest

if TYPE_CHECKING:
    from kubelora.engine.server.protocol import ChatMessage

MAX_TEMPLATE_KWARGS = 64
MAX_TEMPLATE_KWARGS_CHARS = 64 << 10  # as compact JSON
# apply_chat_template's own parameters and the variables it sets: a kwarg under one of these names would
# change how the server renders, not what the template shows.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token",
    "eos_token", "unk_token", "pad_token", "raise_exception", "strftime_now"})


@dataclass(frozen=True)
class TemplateOptions:
    tools: ToolRequest | None = None
    is_continue_final: bool = False  # continue_final_message
    template_kwargs: tuple[tuple[str, Any], ...] = ()  # chat_template_kwargs, in the order given

    def num_chars(self) -> int:
        """Characters the options add to the rendered text at most (for the bound before tokenizing)."""
        kwargs = len(json.dumps(dict(self.template_kwargs))) if self.template_kwargs else 0
        return kwargs + (self.tools.num_chars() if self.tools else 0)


def _take_template_kwargs(f: Fields) -> tuple[tuple[str, Any], ...]:
    if f.take_object("chat_template_kwargs") is None:
        return ()
    raw = f.take_any("chat_template_kwargs")
    if len(raw) > MAX_TEMPLATE_KWARGS:
        raise InvalidRequest(f"'chat_template_kwargs' has {len(raw)} entries; at most {MAX_TEMPLATE_KWARGS} are "
                             "allowed", param="chat_template_kwargs", code="out_of_range")
    for key in raw:
        if not key.isidentifier() or key in RESERVED_TEMPLATE_KWARGS:
            raise InvalidRequest(f"'chat_template_kwargs.{key}' is not allowed: keys must be identifiers, and not "
                                 "one the server sets itself", param="chat_template_kwargs", code="invalid_value")
    num_chars = len(json.dumps(raw, separators=(",", ":")))
    if num_chars > MAX_TEMPLATE_KWARGS_CHARS:
        raise InvalidRequest(f"'chat_template_kwargs' is {num_chars} characters as JSON; at most "
                             f"{MAX_TEMPLATE_KWARGS_CHARS} are allowed", param="chat_template_kwargs",
                             code="out_of_range")
    return tuple(raw.items())


def take_template_options(f: Fields, tools: ToolRequest | None, messages: tuple[ChatMessage, ...]
                          ) -> tuple[bool, TemplateOptions]:
    """add_generation_prompt (default true) and the options; 400 for both prompts at once, as vLLM."""
    add_generation_prompt = f.take_bool("add_generation_prompt", True)
    is_continue = f.take_bool("continue_final_message", False)
    if is_continue and add_generation_prompt:
        raise InvalidRequest("'continue_final_message' and 'add_generation_prompt' cannot both be true (set "
                             "'add_generation_prompt': false)", param="continue_final_message", code="invalid_value")
    if is_continue and messages[-1].role != "assistant":
        raise InvalidRequest(f"'continue_final_message' needs the last message to be the assistant's, got "
                             f"{messages[-1].role!r}", param="continue_final_message", code="invalid_value")
    f.take_unsupported("chat_template")
    return add_generation_prompt, TemplateOptions(tools, is_continue, _take_template_kwargs(f))


def num_template_chars(messages: tuple[ChatMessage, ...], options: TemplateOptions) -> int:
    """Characters of everything the template writes into its text, without its own markup."""
    calls = sum(len(json.dumps(list(m.tool_calls))) for m in messages if m.tool_calls)
    return sum(len(m.content) for m in messages) + calls + options.num_chars()


def conversation(messages: tuple[ChatMessage, ...]) -> list[dict]:
    """The messages as chat templates read them (OpenAI's shape; call arguments decoded, see tools.py)."""
    rendered = []
    for m in messages:
        message: dict = {"role": m.role, "content": m.content}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [dict(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        rendered.append(message)
    return rendered


def render_text(tokenizer, messages: tuple[ChatMessage, ...], add_generation_prompt: bool,
                options: TemplateOptions) -> str:
    """The template's text (blocking; on the tokenizer thread). Template errors propagate to the caller."""
    tools = [dict(t) for t in options.tools.tools] if options.tools else None
    return tokenizer.apply_chat_template(conversation(messages), tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=options.is_continue_final,
                                         **dict(options.template_kwargs))
