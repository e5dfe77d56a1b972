"""From request bytes to a validated request model, or an APIError in the OpenAI shape.

    body bytes ──read_json──► JSON object ──validate──► pydantic model
       413 too large, 415 not JSON,          400 invalid_request_error, param = "messages[0].role"
       400 malformed / not an object

`validate` refuses unknown fields (400 naming them); `validate_ignoring_unknown` drops them instead
and says which (vLLM's behaviour: clients send fields of newer OpenAI APIs). Wrongly typed known
fields are a 400 either way.

Pydantic reports union members in error locations (`content.list[TextPart].0.type`); only real
field names and list indexes make it into `param`.
"""

from __future__ import annotations

import copy
import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from pagedserve.services.gateway.errors import APIError

M = TypeVar("M", bound=BaseModel)
_MAX_PASSES = 4  # dropping unknown fields can expose more (a model validator runs once its fields are valid)


async def read_json(request: Request, max_bytes: int) -> Any:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise APIError(415, "Content-Type must be application/json", code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"the request body exceeds {max_bytes} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"the request body exceeds {max_bytes} bytes", code="request_too_large")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks), parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:  # where it broke helps the client; the parser's own text is not sent
        raise APIError(
            400, f"the request body is not valid JSON (line {exc.lineno}, column {exc.colno})", code="invalid_json"
        ) from None
    except (ValueError, RecursionError):  # bad UTF-8, NaN/Infinity, deep nesting
        raise APIError(
            400, "the request body is not valid JSON (bad UTF-8, NaN/Infinity or nesting too deep)", code="invalid_json"
        ) from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def validate(cls: type[M], body: Any) -> M:
    _check_object(body)
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        raise _to_api_error(cls, exc) from None


def validate_ignoring_unknown(cls: type[M], body: Any) -> tuple[M, list[str]]:
    """The request without its unknown fields, and their paths (`store_x`, `messages[0].extra`).

    Pydantic names each unknown field (`extra_forbidden`) wherever it is, inside unions too; those
    are dropped from a copy of the body and the rest validated again."""
    _check_object(body)
    ignored: list[str] = []
    for _ in range(_MAX_PASSES):
        try:
            return cls.model_validate(body), ignored
        except ValidationError as exc:
            unknown = [e["loc"] for e in exc.errors() if e["type"] == "extra_forbidden"]
            if not unknown:
                raise _to_api_error(cls, exc) from None
            if not ignored:
                body = copy.deepcopy(body)  # the caller's body stays as it was
            ignored += [path for path in (_drop(body, loc) for loc in unknown) if path is not None]
    return validate(cls, body), ignored


def _check_object(body: Any) -> None:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")


def _drop(body: Any, loc: tuple[int | str, ...]) -> str | None:
    """Delete the field at `loc` from `body`; its path, or None when it is not there (already gone).

    Error locations also name union members (`list[TextPart]`): a part that is neither a key of the
    current object nor an index of the current list is such a name and is skipped."""
    node, path = body, ""
    for part in loc[:-1]:
        if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node, path = node[part], f"{path}[{part}]"
        elif isinstance(node, dict) and isinstance(part, str) and part in node:
            node, path = node[part], f"{path}.{part}" if path else part
    name = loc[-1] if loc else None
    if not isinstance(node, dict) or not isinstance(name, str) or name not in node:
        return None
    del node[name]
    return f"{path}.{name}" if path else name


def _to_api_error(cls: type[BaseModel], exc: ValidationError) -> APIError:
    # The deepest error is the most specific one (a union's other members fail near the top).
    error = max(exc.errors(), key=lambda e: len(e["loc"]))
    kind, loc = error["type"], error["loc"]
    names = _field_names(cls)
    if kind == "extra_forbidden" and loc:  # the unknown name itself ends the path
        names = names | {str(loc[-1])}
    param = param_path(loc, names)
    where = param or "body"
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {where}", param=param, code="unknown_parameter")
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{where}'", param=param, code="missing_required_parameter")
    message = error["msg"].removeprefix("Value error, ")
    code = "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value"
    return APIError(400, f"Invalid value for '{where}': {message}", param=param, code=code)


def param_path(loc: tuple[int | str, ...], field_names: set[str]) -> str | None:
    """('messages', 0, 'content', 'list[TextPart]', 1, 'type') -> 'messages[0].content[1].type'."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in field_names:
            path += f".{part}" if path else part
    return path or None


_FIELD_NAMES: dict[type[BaseModel], set[str]] = {}


def _field_names(cls: type[BaseModel]) -> set[str]:
    """Every field name of `cls` and of the models nested in it."""
    if cls not in _FIELD_NAMES:
        names: set[str] = set()
        todo, seen = [cls], set()
        while todo:
            model = todo.pop()
            if model in seen:
                continue
            seen.add(model)
            for name, info in model.model_fields.items():
                names.add(name)
                todo.extend(_nested_models(info.annotation))
        _FIELD_NAMES[cls] = names
    return _FIELD_NAMES[cls]


def _nested_models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _nested_models(arg)]
