"""The real-traffic workload of `kubelora bench serve`: who sends what, and when. Pure: numpy and a seed.

- Tenants: one per registered adapter; a tenant's popularity is Zipf(s) over the adapters' ranks
  (p_k proportional to 1 / k^s, k = 1..N), each with a fixed system prompt of a length drawn once from
  U[system_tokens].
- Conversations start as a Poisson process; each has U{turns} turns. A turn's prompt is the system prompt and the
  whole history (every earlier user message and answer) and the new user message; the next turn is sent a think
  time (exponential) after the answer ends. The rate swept is requests per second, so conversations start at
  rate / mean turns.
- Lengths: a user message and an answer are lognormal with the means LMSYS-Chat-1M reports per turn
  (`LMSYS_*`, docs/benchmarks-serve.md cites them), clipped to [1, max].

Workload kinds: `chat` (the above), `no-prefix` (one turn, no system prompt, a prompt of the same total length
as a chat turn's, unique from its first word: what a prefix cache cannot help) and `uniform` (S-LoRA's synthetic
workload: one turn, no system prompt, input and output lengths U[8, 512], within the caps).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

# LMSYS-Chat-1M (Zheng et al., ICLR 2024, arXiv:2309.11998, Table 1): 1M conversations; on average 2.0 turns per
# conversation, 69.5 tokens per user prompt, 214.5 tokens per response.
LMSYS_PROMPT_TOKENS = 69.5
LMSYS_ANSWER_TOKENS = 214.5
# The paper gives means, not shapes. Lognormal with sigma 1 is our choice: a long right tail (p99 about 6.5x the
# median), as chat lengths have.
LENGTH_SIGMA = 1.0
# S-LoRA (Sheng et al., MLSys 2024, arXiv:2311.03285) synthetic workload: input and output lengths U[8, 512].
SLORA_LENGTHS = (8, 512)


class WorkloadKind(enum.Enum):
    CHAT = "chat"
    NO_PREFIX = "no-prefix"
    UNIFORM = "uniform"


@dataclass(frozen=True)
class WorkloadConfig:
    kind: WorkloadKind = WorkloadKind.CHAT
    num_adapters: int = 1000
    zipf_s: float = 1.0
    system_tokens: tuple[int, int] = (1000, 2000)  # U[low, high] per tenant
    turns: tuple[int, int] = (3, 5)  # U{low..high} per conversation
    prompt_mean_tokens: float = LMSYS_PROMPT_TOKENS
    answer_mean_tokens: float = LMSYS_ANSWER_TOKENS
    max_prompt_tokens: int = 1024  # one user message
    max_answer_tokens: int = 1024
    think_s: float = 1.0  # mean think time between an answer and the next turn
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_adapters < 1:
            raise ValueError(f"num_adapters must be >= 1, got {self.num_adapters}")
        if self.zipf_s < 0:
            raise ValueError(f"zipf_s must be >= 0 (0: uniform), got {self.zipf_s}")
        for name in ("system_tokens", "turns"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be 1 <= low <= high, got {low}..{high}")
        if min(self.prompt_mean_tokens, self.answer_mean_tokens) < 1:
            raise ValueError("prompt_mean_tokens and answer_mean_tokens must be >= 1")
        if min(self.max_prompt_tokens, self.max_answer_tokens) < 1:
            raise ValueError("max_prompt_tokens and max_answer_tokens must be >= 1")
        if self.think_s < 0:
            raise ValueError(f"think_s must be >= 0 seconds, got {self.think_s}")

    @property
    def mean_turns(self) -> float:
        return 1.0 if self.kind is not WorkloadKind.CHAT else (self.turns[0] + self.turns[1]) / 2


@dataclass(frozen=True)
class Conversation:
    adapter: int  # index into the registered adapters; also the tenant
    start_s: float  # the first turn's send time from the run's start
    system_tokens: int  # 0: no system prompt
    user_tokens: tuple[int, ...]  # one per turn
    answer_tokens: tuple[int, ...]  # max_tokens per turn
    think_s: tuple[float, ...]  # pause before each turn after the first
    text_seed: int  # the words of its user messages (and of its prompt in no-prefix and uniform)

    @property
    def num_turns(self) -> int:
        return len(self.user_tokens)


def zipf_weights(num_adapters: int, s: float) -> np.ndarray:
    ranks = np.arange(1, num_adapters + 1, dtype=np.float64)
    weights = ranks ** -s
    return weights / weights.sum()


def tenant_system_tokens(config: WorkloadConfig) -> np.ndarray:
    """Each tenant's system prompt length (fixed for the tenant across rates and runs of the same seed)."""
    rng = np.random.default_rng([config.seed, 1])
    low, high = config.system_tokens
    return rng.integers(low, high + 1, size=config.num_adapters)


def _lognormal(rng: np.random.Generator, mean: float, size: int, cap: int) -> np.ndarray:
    mu = np.log(mean) - LENGTH_SIGMA ** 2 / 2  # the lognormal's mean is exp(mu + sigma^2 / 2)
    return np.clip(np.rint(rng.lognormal(mu, LENGTH_SIGMA, size)), 1, cap).astype(int)


def _uniform(rng: np.random.Generator, cap: int) -> int:
    """S-LoRA's U[8, 512], within the workload's cap."""
    low, high = (min(bound, cap) for bound in SLORA_LENGTHS)
    return int(rng.integers(low, high + 1))


def build_conversations(config: WorkloadConfig, rate: float, duration_s: float, seed: int) -> list[Conversation]:
    """The conversations starting within `duration_s` at `rate` requests per second."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be > 0, got {rate} and {duration_s}")
    rng = np.random.default_rng([config.seed, 2, seed])
    starts = _poisson_starts(rng, rate / config.mean_turns, duration_s)
    adapters = rng.choice(config.num_adapters, size=len(starts), p=zipf_weights(config.num_adapters, config.zipf_s))
    systems = tenant_system_tokens(config)
    return [_conversation(config, rng, int(adapter), float(start), int(systems[adapter]))
            for start, adapter in zip(starts, adapters)]


def _poisson_starts(rng: np.random.Generator, rate: float, duration_s: float) -> np.ndarray:
    # Enough exponential gaps to pass the duration with near certainty, then cut at the duration.
    count = int(rate * duration_s + 10 * np.sqrt(rate * duration_s) + 10)
    starts = np.cumsum(rng.exponential(1 / rate, size=count))
    return starts[starts < duration_s]


def _conversation(config: WorkloadConfig, rng: np.random.Generator, adapter: int, start: float,
                  system: int) -> Conversation:
    text_seed = int(rng.integers(2**62))
    if config.kind is WorkloadKind.UNIFORM:
        return Conversation(adapter, start, 0, (_uniform(rng, config.max_prompt_tokens),),
                            (_uniform(rng, config.max_answer_tokens),), (), text_seed)
    if config.kind is WorkloadKind.NO_PREFIX:
        # A chat's first turn as one unshared prompt: the tenant's system prompt length plus a user message.
        user = int(_lognormal(rng, config.prompt_mean_tokens, 1, config.max_prompt_tokens)[0])
        answer = int(_lognormal(rng, config.answer_mean_tokens, 1, config.max_answer_tokens)[0])
        return Conversation(adapter, start, 0, (system + user,), (answer,), (), text_seed)
    num_turns = int(rng.integers(config.turns[0], config.turns[1] + 1))
    return Conversation(adapter, start, system,
                        tuple(_lognormal(rng, config.prompt_mean_tokens, num_turns, config.max_prompt_tokens).tolist()),
                        tuple(_lognormal(rng, config.answer_mean_tokens, num_turns, config.max_answer_tokens).tolist()),
                        tuple(rng.exponential(config.think_s, size=num_turns - 1).tolist()) if config.think_s else
                        (0.0,) * (num_turns - 1), text_seed)


# ---- text ----

# Words the prompts are made of; a tokenizer's tokens per word is measured once (`TextMaker`), since the router
# and the engine see text, and the benchmark counts tokens.
WORDS = tuple("""the of and to in is that for it as with was on be by this are at from or an have not which but
all were when we there can more one been has their if will would about into so what up out them some other time
could these two may then do first any my now such like our over new also after only most made where system
service cluster model adapter request answer question tenant prompt memory cache token replica router engine
""".split())


class TextMaker:
    """Text of about n tokens of a given tokenizer: n / tokens_per_word words drawn from WORDS."""

    def __init__(self, tokens_per_word: float) -> None:
        if tokens_per_word <= 0:
            raise ValueError(f"tokens_per_word must be > 0, got {tokens_per_word}")
        self.tokens_per_word = tokens_per_word

    def text(self, num_tokens: int, seed: int | list[int]) -> str:
        rng = np.random.default_rng(seed)
        num_words = max(1, round(num_tokens / self.tokens_per_word))
        return " ".join(WORDS[i] for i in rng.integers(len(WORDS), size=num_words))

    def system_prompt(self, config: WorkloadConfig, adapter: int, num_tokens: int) -> str:
        """The tenant's system prompt: the same text for every conversation of the tenant."""
        return f"You are the assistant of tenant {adapter}. " + self.text(num_tokens, [config.seed, 3, adapter])

    def user_message(self, conversation: Conversation, turn: int) -> str:
        # The turn number first: no two prompts of a conversation, nor of two conversations, start alike by chance.
        return f"[{conversation.text_seed % 10**9}:{turn}] " + self.text(conversation.user_tokens[turn],
                                                                         [conversation.text_seed, turn])


def turn_messages(system: str | None, users: list[str], answers: list[str]) -> list[dict]:
    """A turn's chat messages: the system prompt, then each earlier user message and its answer, then the new user
    message (`users` has one more entry than `answers`)."""
    if len(users) != len(answers) + 1:
        raise ValueError(f"a turn has one user message more than answers, got {len(users)} and {len(answers)}")
    messages = [{"role": "system", "content": system}] if system else []
    for user, answer in zip(users, answers):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": users[-1]}]
