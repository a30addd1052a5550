"""Structured output: a request's grammar (JSON schema, JSON object, regex, choice, EBNF) compiled once per spec
off the engine thread, and one matcher per sequence that masks the logits and follows the sampled tokens."""

from kubelora.engine.structured.spec import StructuredKind, StructuredOutput

__all__ = ["StructuredKind", "StructuredOutput"]
