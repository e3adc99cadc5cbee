"""Rules a request must pass at every front door, checked once here; each door only words the
refusal for its wire (`Refused.field` names what was wrong)."""

from __future__ import annotations

from typing import Any, Mapping

from ..engine import ErrorKind, OptionSpec, Refused, type_name


def check_options(raw: Any, specs: Mapping[str, OptionSpec]) -> dict[str, Any]:
    """A request's generation options against those the served engine declares: each value in
    its option's type; unknown names and bad values refused (INVALID, field `options.NAME`)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise Refused(ErrorKind.INVALID, f"field 'options' must be a map, got {type_name(raw)}", field="options")
    out: dict[str, Any] = {}
    for name, value in raw.items():
        spec = specs.get(name)
        if spec is None:
            raise Refused(ErrorKind.INVALID, f"unknown option 'options.{name}' (known: {sorted(specs)})",
                          field=f"options.{name}")
        try:
            out[name] = spec.check(value)
        except ValueError as exc:
            raise Refused(ErrorKind.INVALID, f"option 'options.{name}' {exc}", field=f"options.{name}") from None
    if "min_len" in out and "max_len" in out and out["min_len"] > out["max_len"]:
        raise Refused(ErrorKind.INVALID, "option 'options.min_len' must not exceed 'options.max_len'",
                      field="options.min_len")
    return out
