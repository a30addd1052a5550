"""Structured-output request fields -> one `StructuredOutput`; its grammar compiled at admission, off the loop.

Accepted (one of them per request): OpenAI's `response_format` (`text`, `json_object`, `json_schema`), vLLM's
`structured_outputs` {`json`, `regex`, `choice`, `grammar`, `json_object`} and vLLM's older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`. A grammar that does not compile is 400 naming its field.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

from kubelora.contract.errors import InvalidRequest
from kubelora.engine.sampling_params import SamplingParams
from kubelora.engine.server.fields import Fields
from kubelora.engine.server.json_body import check_tree
from kubelora.engine.structured import StructuredKind, StructuredOutput

MAX_SPEC_CHARS = 256 * 1024  # a schema (as compact JSON), regex or grammar: compile time grows with it
MAX_CHOICES = 256
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def take_structured(f: Fields) -> StructuredOutput | None:
    """The request's one structured-output constraint (None: free text); 400 when two are given."""
    found = [s for s in (_take_response_format(f), _take_structured_outputs(f)) if s is not None]
    found += [s for key, kind in _GUIDED.items() if (s := _spec(kind, f.take_any(key), f.name(key))) is not None]
    if len(found) > 1:
        raise InvalidRequest(f"'{found[0].param}' and '{found[1].param}' both constrain the output; give one",
                             param=found[1].param, code="invalid_value")
    return found[0] if found else None


async def attach_grammar(engine, params: SamplingParams) -> SamplingParams:
    """`params` with its grammar compiled on the engine's compile pool (cached by spec); InvalidRequest if the
    schema, regex or grammar does not compile."""
    if params.structured is None:
        return params
    spec = await asyncio.wrap_future(engine.grammars.submit(params.structured))
    return replace(params, structured=spec)


def _take_response_format(f: Fields) -> StructuredOutput | None:
    rf = f.take_object("response_format")
    if rf is None:
        return None
    kind = rf.take_str("type", required=True)
    if kind == "text":
        spec = None
    elif kind == "json_object":
        spec = StructuredOutput(StructuredKind.JSON_OBJECT, "", rf.name("type"))
    elif kind == "json_schema":
        js = rf.take_object("json_schema")
        if js is None:
            raise InvalidRequest(f"'{rf.name('json_schema')}' is required with type json_schema",
                                 param=rf.name("json_schema"), code="missing_field")
        js.take_str("name"), js.take_str("description"), js.take_bool("strict", False)
        spec = _spec("json", js.take_any("schema", required=True), js.name("schema"))
        js.finish()
    else:
        raise InvalidRequest(f"'{rf.name('type')}' must be text, json_object or json_schema, got {kind!r}",
                             param=rf.name("type"), code="unsupported_value")
    rf.finish()
    return spec


def _take_structured_outputs(f: Fields) -> StructuredOutput | None:
    so = f.take_object("structured_outputs")
    if so is None:
        return None
    found = [s for key in _STRUCTURED_KEYS if (s := _spec(key, so.take_any(key), so.name(key))) is not None]
    so.finish()
    if len(found) != 1:
        raise InvalidRequest(f"'{f.name('structured_outputs')}' must set exactly one of {', '.join(_STRUCTURED_KEYS)}",
                             param=f.name("structured_outputs"), code="invalid_value")
    return found[0]


def _spec(kind: str, value: Any, param: str) -> StructuredOutput | None:
    if value is None:
        return None
    if kind == "json":
        return _json_schema(value, param)
    if kind == "json_object":
        if not isinstance(value, bool):
            raise InvalidRequest(f"'{param}' must be a boolean", param=param, code="invalid_type")
        return StructuredOutput(StructuredKind.JSON_OBJECT, "", param) if value else None
    if kind == "choice":
        return _choice(value, param)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"'{param}' must be a non-empty string", param=param, code="invalid_type")
    _check_size(value, param)
    return StructuredOutput(StructuredKind.REGEX if kind == "regex" else StructuredKind.GRAMMAR, value, param)


def _json_schema(value: Any, param: str) -> StructuredOutput:
    if isinstance(value, str):  # vLLM's guided_json takes the schema as JSON text too
        _check_size(value, param)
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"'{param}' is not valid JSON: {exc.msg} at character {exc.pos}", param=param,
                                 code="invalid_value") from None
        except RecursionError:
            raise InvalidRequest(f"'{param}' is nested too deeply", param=param, code="invalid_value") from None
        if isinstance(value, dict):
            check_tree(value, param)  # its escapes may spell lone surrogates; its depth is bounded like a body's
    if not isinstance(value, dict):
        raise InvalidRequest(f"'{param}' must be a JSON schema object", param=param, code="invalid_type")
    spec = StructuredOutput.json_schema(value, param)
    _check_size(spec.value, param)
    return spec


def _choice(value: Any, param: str) -> StructuredOutput:
    if not isinstance(value, list) or not value or not all(isinstance(o, str) and o for o in value):
        raise InvalidRequest(f"'{param}' must be a non-empty array of non-empty strings", param=param,
                             code="invalid_type")
    if len(value) > MAX_CHOICES:
        raise InvalidRequest(f"'{param}' has {len(value)} choices; at most {MAX_CHOICES}", param=param,
                             code="out_of_range")
    spec = StructuredOutput.choice(value, param)
    _check_size(spec.value, param)
    return spec


def _check_size(text: str, param: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidRequest(f"'{param}' is {len(text)} characters; at most {MAX_SPEC_CHARS}", param=param,
                             code="out_of_range")
