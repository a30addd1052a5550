"""`kubelora bench serve`'s load generator: one asyncio loop, the openai SDK's streaming chat client, open loop.

Each conversation starts at its scheduled time whatever the server's state (open loop); its later turns follow
their answers after a think time. A request records its send time, the time of its first content chunk, its end,
and the usage of its last chunk (`stream_options.include_usage`): prompt and completion tokens and, when the
server reports them, `prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from dataclasses import dataclass

from kubelora.bench.serve_workload import Conversation, TextMaker, WorkloadConfig, turn_messages

# vLLM's prefix cache counters (tokens), as the engine exports them; a scrape shows counters with `_total`.
PREFIX_CACHE_METRICS = {"vllm:prefix_cache_queries": "queries", "vllm:prefix_cache_hits": "hits"}


@dataclass(frozen=True)
class RequestRecord:
    conversation: int
    turn: int
    adapter: str
    sent_s: float  # from the run's start
    ttft_s: float | None  # None: the request failed before its first token
    end_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # None: the server did not report it
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first (None for fewer than two tokens)."""
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.end_s - self.sent_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass(frozen=True)
class Traffic:
    """What the driver needs besides the conversations: the server, the adapters' names and how to make text."""
    url: str
    adapter_names: tuple[str, ...]
    workload: WorkloadConfig
    text: TextMaker
    max_context_tokens: int  # a conversation ends before a turn whose prompt and answer would pass it
    request_timeout_s: float


async def run_conversations(traffic: Traffic, conversations: list[Conversation]) -> list[RequestRecord]:
    from openai import AsyncOpenAI

    # The SDK's pool allows 1,000 connections: an open loop stays open up to 1,000 requests in flight.
    client = AsyncOpenAI(base_url=f"{traffic.url}/v1", api_key="unused", max_retries=0,
                         timeout=traffic.request_timeout_s)
    start = time.perf_counter()
    try:
        per_conversation = await asyncio.gather(*(_conversation(client, traffic, index, conversation, start)
                                                  for index, conversation in enumerate(conversations)))
    finally:
        await client.close()
    return [record for records in per_conversation for record in records]


async def _conversation(client, traffic: Traffic, index: int, conversation: Conversation,
                        start: float) -> list[RequestRecord]:
    await asyncio.sleep(max(0.0, start + conversation.start_s - time.perf_counter()))
    system = None
    if conversation.system_tokens:
        system = traffic.text.system_prompt(traffic.workload, conversation.adapter, conversation.system_tokens)
    users, answers, records = [], [], []
    context = conversation.system_tokens
    for turn in range(conversation.num_turns):
        context += conversation.user_tokens[turn] + conversation.answer_tokens[turn]
        if turn and context > traffic.max_context_tokens:
            break
        if turn:
            await asyncio.sleep(conversation.think_s[turn - 1])
        users.append(traffic.text.user_message(conversation, turn))
        record, answer = await _request(client, traffic, index, turn, conversation,
                                        turn_messages(system, users, answers), start)
        records.append(record)
        if record.error is not None:
            break  # a real client would not go on with a conversation whose answer it did not get
        answers.append(answer)
    return records


async def _request(client, traffic: Traffic, index: int, turn: int, conversation: Conversation,
                   messages: list[dict], start: float) -> tuple[RequestRecord, str]:
    adapter = traffic.adapter_names[conversation.adapter]
    sent = time.perf_counter()
    first, usage, pieces = None, None, []
    try:
        stream = await client.chat.completions.create(
            model=adapter, messages=messages, max_tokens=conversation.answer_tokens[turn], temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first if first is not None else time.perf_counter()
                    pieces.append(choice.delta.content)
            usage = chunk.usage or usage
    except Exception as exc:  # a failed request is a row of the report, not the end of the run
        return _record(index, turn, adapter, sent, first, start, None, f"{type(exc).__name__}: {exc}"), ""
    error = None if usage is not None else "the stream carried no usage"
    return _record(index, turn, adapter, sent, first, start, usage, error), "".join(pieces)


def _record(index: int, turn: int, adapter: str, sent: float, first: float | None, start: float, usage,
            error: str | None) -> RequestRecord:
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    return RequestRecord(conversation=index, turn=turn, adapter=adapter, sent_s=sent - start,
                         ttft_s=first - sent if first is not None else None, end_s=time.perf_counter() - start,
                         prompt_tokens=usage.prompt_tokens if usage is not None else 0,
                         completion_tokens=usage.completion_tokens if usage is not None else 0,
                         cached_tokens=cached if isinstance(cached, int) else None, error=error)


def prefix_cache_counters(url: str) -> dict[str, float] | None:
    """The server's prefix cache counters now ({"queries", "hits"}, tokens), or None when it exports neither."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return None
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in PREFIX_CACHE_METRICS and not sample.name.endswith("_created"):
                key = PREFIX_CACHE_METRICS[name]
                found[key] = found.get(key, 0.0) + sample.value
    return found if set(found) == set(PREFIX_CACHE_METRICS.values()) else None
