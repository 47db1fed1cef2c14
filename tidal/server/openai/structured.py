"""Which output constraint a request asks for, from OpenAI's `response_format` or vLLM's
`structured_outputs` / `guided_*` fields, as `SamplingParams.structured` (kind, spec).
At most one may be set; each is checked for shape here and compiled against the model's
tokenizer by the frontend (tidal.engine.structured), so a bad one is a 400 naming it."""

from __future__ import annotations

import json
from typing import Any


class ConstraintError(ValueError):
    """A constraint field of the wrong shape: the field (`param`) and what is wrong."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# vLLM's structured_outputs keys -> tidal's kinds
_VLLM_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
              "json_object": "json"}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
ANY_OBJECT = json.dumps({"type": "object"})


def _spec(kind: str, value: Any, field: str) -> str:
    """The spec text of one constraint, or a 400 naming `field`."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ConstraintError(field, f"{field} must be a JSON schema (an object)") \
                    from None
        if not isinstance(value, dict):
            raise ConstraintError(field, f"{field} must be a JSON schema (an object)")
        return json.dumps(value)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
            raise ConstraintError(field, f"{field} must be a non-empty list of strings")
        return json.dumps(value)
    if not isinstance(value, str) or not value:
        raise ConstraintError(field, f"{field} must be a non-empty string")
    return value


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that declares
    `properties` and says nothing of others, as OpenAI's strict mode and the grammar
    engines of vLLM and SGLang read tool parameters: a forced call then cannot invent
    properties until max_tokens. An explicit `additionalProperties` is kept (the opt-out)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: closed_objects(v) for k, v in value.items()}
        elif key in _SUBSCHEMA_LISTS or key in _SUBSCHEMAS:
            out[key] = closed_objects(value)
        else:
            out[key] = value
    if "properties" in out and not {"additionalProperties", "patternProperties",
                                    "unevaluatedProperties"} & out.keys():
        out["additionalProperties"] = False
    return out


def _response_format(value: dict) -> tuple[str, str] | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json", ANY_OBJECT
    if kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema")
        if schema is None:
            raise ConstraintError("response_format.json_schema.schema",
                                  "response_format json_schema needs json_schema.schema")
        if value["json_schema"].get("strict") is True and isinstance(schema, dict):
            schema = closed_objects(schema)
        return "json", _spec("json", schema, "response_format.json_schema.schema")
    raise ConstraintError("response_format.type", f"response_format type {kind!r} is not "
                                                  "supported (text, json_object, json_schema)")


def structured_spec(body) -> tuple[str, tuple[str, str]] | None:
    """The one constraint of a request body as (its field, (kind, spec)), or None."""
    found: list[tuple[str, tuple[str, str] | None]] = []
    if body.response_format is not None:
        found.append(("response_format", _response_format(body.response_format)))
    if body.structured_outputs is not None:
        keys = [k for k, v in body.structured_outputs.items() if v not in (None, False)]
        unknown = [k for k in keys if k not in _VLLM_KEYS]
        if unknown:
            raise ConstraintError(f"structured_outputs.{unknown[0]}",
                                  f"structured_outputs.{unknown[0]} is not supported (json, "
                                  "regex, choice, grammar, json_object)")
        for key in keys:
            field = f"structured_outputs.{key}"
            value = body.structured_outputs[key]
            spec = ANY_OBJECT if key == "json_object" else _spec(_VLLM_KEYS[key], value, field)
            found.append((field, (_VLLM_KEYS[key], spec)))
    for name, kind in _GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            found.append((name, (kind, _spec(kind, value, name))))
    asked = [(field, spec) for field, spec in found if spec is not None]
    if len(asked) > 1:
        raise ConstraintError(asked[1][0], f"{asked[1][0]} and {asked[0][0]} both constrain "
                                           "the output: send one")
    return asked[0] if asked else None
