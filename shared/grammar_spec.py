"""What a request's output must match: a JSON schema, any JSON, a regex, one of some strings, or an
EBNF grammar. Plain data: it travels in the wire's sampling dict as `{"kind": ..., "value": ...}` and
keys the engine's compile cache. In shared/ because the gateway checks specs (a 400 before any byte)
and the engine compiles them; the grammar library is imported only by `check_spec`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: str  # one of KINDS
    value: str = ""  # json: the schema as canonical JSON; regex/grammar: the text; choice: a JSON list

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured_output: unknown kind {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError("structured_output: value must be a string")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> GrammarSpec:
        return cls("json", json.dumps(schema, separators=(",", ":")))  # key order is the output order

    @classmethod
    def choice(cls, options: list[str]) -> GrammarSpec:
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def from_wire(cls, value: Any) -> GrammarSpec:
        if isinstance(value, GrammarSpec):
            return value
        if not isinstance(value, dict) or "kind" not in value:
            raise ValueError("structured_output: expected {kind, value}")
        return cls(str(value["kind"]), value.get("value", ""))

    def to_wire(self) -> dict[str, str]:
        return {"kind": self.kind, "value": self.value}

    def choice_ebnf(self) -> str:
        """`root ::= "a" | "b"`: JSON string escapes are valid EBNF literal escapes."""
        options = json.loads(self.value)
        if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError("choice: must be a non-empty list of non-empty strings")
        return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


def check_spec(spec: GrammarSpec) -> None:
    """Parse the spec into a grammar without a tokenizer (cheap): ValueError with the reason if invalid."""
    import xgrammar as xgr

    try:
        if spec.kind == "json":
            xgr.Grammar.from_json_schema(spec.value, any_whitespace=False)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.value)
        elif spec.kind == "choice":
            xgr.Grammar.from_ebnf(spec.choice_ebnf())
        elif spec.kind == "grammar":
            xgr.Grammar.from_ebnf(spec.value)
    except ValueError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError / its own types for bad input
        raise ValueError(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__) from None
