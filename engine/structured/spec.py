"""What a request asks its output to match; compiled by `compiler.GrammarCompiler`, cached by (kind, value)."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field


class StructuredKind(enum.Enum):
    JSON_SCHEMA = "json"
    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's response_format json_object)
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"  # EBNF (xgrammar's GBNF dialect)


@dataclass(frozen=True)
class StructuredOutput:
    """`value`: the schema as canonical JSON text, the regex, the grammar, or the choices as a JSON array
    (json_object: ""). `param` names the request field it came from, for error messages only. `grammar` is the
    compiled form, attached before the request reaches the engine (None: `LLMEngine.add_request` compiles it)."""

    kind: StructuredKind
    value: str
    param: str = field(default="structured_outputs", compare=False)
    grammar: object | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, StructuredKind):
            raise ValueError(f"kind must be a StructuredKind, got {self.kind!r}")
        if self.kind is not StructuredKind.JSON_OBJECT and not self.value:
            raise ValueError(f"{self.param} must not be empty")

    @property
    def key(self) -> tuple[str, str]:
        return self.kind.value, self.value

    @classmethod
    def json_schema(cls, schema: dict | str, param: str = "structured_outputs.json") -> StructuredOutput:
        """A schema as a dict or JSON text, stored compact (key order kept: it is the order properties are
        generated in). Raises ValueError for text that is not JSON."""
        parsed = json.loads(schema) if isinstance(schema, str) else schema
        return cls(StructuredKind.JSON_SCHEMA, json.dumps(parsed, separators=(",", ":")), param)

    @classmethod
    def choice(cls, options: list[str] | tuple[str, ...], param: str = "structured_outputs.choice") -> StructuredOutput:
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError(f"{param} must be a non-empty list of non-empty strings")
        return cls(StructuredKind.CHOICE, json.dumps(list(options), ensure_ascii=False), param)

    def with_grammar(self, grammar: object) -> StructuredOutput:
        return StructuredOutput(self.kind, self.value, self.param, grammar)
