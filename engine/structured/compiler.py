"""Grammar compilation (xgrammar), off the engine thread and cached by spec.

The server compiles at admission on this compiler's own threads (`submit`, each compile under a deadline:
compile_pool.py), so neither the event loop nor the engine thread ever compiles; `compile` is the same work on
the caller's thread, without a deadline (the offline `LLM`). The tokenizer's vocabulary is indexed once, at the
first structured request, not at engine start, and outside any compile's deadline.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future

from kubelora.contract.errors import InvalidRequest
from kubelora.engine.structured.compile_pool import CompileLimits, CompilePool
from kubelora.engine.structured.spec import StructuredKind, StructuredOutput

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept (LRU); a JSON schema's is tens of KB to a few MB
NUM_XGRAMMAR_THREADS = 2  # xgrammar's own threads for one compile


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
                 limits: CompileLimits = CompileLimits()) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler = None  # xgrammar.GrammarCompiler, built on first use
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()
        self.pool = CompilePool(self._compile_on_pool, limits)

    def submit(self, spec: StructuredOutput) -> Future:
        """A future of the spec with its grammar attached: at once when cached, else compiled on a grammar
        thread under the pool's deadline. Raises Unavailable when the pool has no room (compile_pool.py)."""
        with self._lock:
            grammar = self._cache.get(spec.key)
            if grammar is not None:
                self._cache.move_to_end(spec.key)
        if grammar is None:
            return self.pool.submit(spec)
        future: Future = Future()
        future.set_result(spec.with_grammar(grammar))
        return future

    def _compile_on_pool(self, spec: StructuredOutput):
        self._xgrammar_compiler()  # indexing the vocabulary is no part of a compile's deadline
        self.pool.arm(spec)
        return self.compile(spec)

    def compile(self, spec: StructuredOutput):
        """The compiled grammar (xgrammar.CompiledGrammar); InvalidRequest naming `spec.param` if it is invalid."""
        with self._lock:
            if spec.key in self._cache:
                self._cache.move_to_end(spec.key)
                return self._cache[spec.key]
        compiled = _compile(self._xgrammar_compiler(), spec)
        with self._lock:
            self._cache[spec.key] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def close(self) -> None:
        self.pool.close()

    def _xgrammar_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                               stop_token_ids=self._stop_token_ids)
                # xgrammar's own cache stays off: ours is keyed by spec and bounded by count.
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=NUM_XGRAMMAR_THREADS,
                                                          cache_enabled=False)
            return self._compiler


def _compile(compiler, spec: StructuredOutput):
    try:
        # Fixed separators (", ", ": "), no free whitespace: a model cannot pad the output with endless blanks.
        if spec.kind is StructuredKind.JSON_SCHEMA:
            return compiler.compile_json_schema(spec.value, any_whitespace=False)
        if spec.kind is StructuredKind.JSON_OBJECT:  # any object (xgrammar's builtin JSON grammar allows arrays)
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind is StructuredKind.REGEX:
            return compiler.compile_regex(spec.value)
        if spec.kind is StructuredKind.CHOICE:
            return compiler.compile_grammar(choice_grammar(json.loads(spec.value)))
        return compiler.compile_grammar(spec.value)
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar reports bad input as RuntimeError
        raise InvalidRequest(f"'{spec.param}' is not a valid {_describe(spec.kind)}: {_detail(exc)}", param=spec.param,
                             code="invalid_value") from None


def _detail(exc: Exception) -> str:
    """xgrammar's message without its "[time] file.cc:line:" prefix, first line, bounded."""
    lines = str(exc).strip().splitlines()
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0])[:300] if lines else type(exc).__name__


def choice_grammar(options: list[str]) -> str:
    """EBNF whose only sentences are the options (JSON string escapes are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


def _describe(kind: StructuredKind) -> str:
    return {StructuredKind.JSON_SCHEMA: "JSON schema", StructuredKind.REGEX: "regular expression",
            StructuredKind.GRAMMAR: "EBNF grammar"}.get(kind, "choice list")
