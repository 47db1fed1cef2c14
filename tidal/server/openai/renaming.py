"""A translated request's errors in the client's words: the Messages API and SGLang's
native API run as chat and completions requests, whose 400s name chat's and completions'
fields; these name the fields as the client sent them."""

from __future__ import annotations

import re
from collections.abc import Mapping

from pydantic import ValidationError

from tidal.server.openai.protocol import APIError


def renamed(text: str, words: Mapping[str, str]) -> str:
    """`text` with each field name of `words` (as a whole word: not part of a flag's
    dashed name either) in the client's words."""
    if not words:
        return text
    pattern = r"(?<![\w-])(" + "|".join(map(re.escape, words)) + r")(?![\w-])"
    return re.sub(pattern, lambda m: words[m.group(1)], text)


def renamed_error(exc: ValidationError, params: Mapping[str, str],
                  words: Mapping[str, str] | None = None) -> APIError:
    """The first validation error of a request translated from another API's body (the
    Messages API's, SGLang's), naming the field as the client sent it: `params` maps a
    translated field to the client's path, `words` (default: `params`) its name in text."""
    words = params if words is None else words
    first = exc.errors()[0]
    loc = [str(p) for p in first["loc"] if isinstance(p, int) or p[:1].islower()]
    if first["type"] == "refused":
        loc.append(first["ctx"]["param"])
    if loc:
        loc[0] = params.get(loc[0], loc[0])
    where = ".".join(loc) or None
    message = renamed(first["msg"], words)
    if first["type"] != "refused":
        message = f"{where or 'body'}: {message}"
    return APIError(message, param=where)


def in_terms(exc: APIError, params: Mapping[str, str],
             words: Mapping[str, str] | None = None) -> APIError:
    """A check's APIError on the translated request, naming the client's field
    (`params`: a field -> its path there; `words`, default `params`: its name in text)."""
    exc.param = params.get(exc.param, exc.param)
    exc.message = renamed(exc.message, params if words is None else words)
    return exc
