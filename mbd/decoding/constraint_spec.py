"""What a request's structured output is, before any grammar is compiled: the constraint in its canonical text
(`ConstraintSpec`) and the error that names the request field it cannot be honoured for (`ConstraintError`).
Plain data, no torch: the ingress builds these (serve_app/convert.py); mbd/decoding/constraints.py compiles them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Kind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]


class ConstraintError(ValueError):
    """A constraint the server cannot honour exactly (an HTTP 400): `field` names the request field, `feature`
    the schema keyword or construct that is not supported (None when the problem is not a feature)."""

    def __init__(self, field: str, message: str, feature: str | None = None):
        super().__init__(f"{field}: {message}")
        self.field, self.feature = field, feature


@dataclass(frozen=True)
class ConstraintSpec:
    """One request's constraint, in its canonical text: a JSON schema (compact JSON), a regex, a JSON list of
    choices or a Lark grammar. `field` is the request field it came from (for error messages)."""

    kind: Kind
    text: str = ""
    field: str = "response_format"

    @classmethod
    def json_schema(cls, schema: dict | str | bool, field: str = "response_format.json_schema.schema") -> "ConstraintSpec":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(field, f"is not valid JSON: {e.msg}") from e
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(field, "must be a JSON object (a JSON schema)")
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), field)

    @classmethod
    def choice(cls, options: Sequence[str], field: str = "choice") -> "ConstraintSpec":
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ConstraintError(field, "must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(options)), field)
