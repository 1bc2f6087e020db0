"""What every settings struct shares: the error type and declarative validation.

A setting's rules live on its annotation (`Literal[...]` choices, `msgspec.Meta(ge=..., gt=...)` bounds,
`Meta(description=...)` help text). msgspec checks them when a struct is decoded; `ConfigStruct.__post_init__`
checks them when one is built in code too, so both ways give the same one-line `ConfigError` naming the field.
"""
from __future__ import annotations

import functools
import typing
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import msgspec.inspect as mi


class ConfigError(ValueError):
    """An engine setting is invalid; the CLI prints it as one line."""


@dataclass(frozen=True)
class Setting:
    """One field of a settings struct, as the CLI and the error messages need it."""

    name: str
    annotation: Any  # the full annotation, constraints included
    kind: type  # int, float, str or bool: the type of a value that is given
    choices: tuple[Any, ...] | None  # a Literal's values
    default: Any
    required: bool
    description: str
    expected: str  # "an integer >= 1", "one of fused, sync", ... for error messages


class ConfigStruct(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of the per-concern settings: frozen, unknown fields refused, rules checked on construction."""

    def __post_init__(self) -> None:
        for setting in settings_of(type(self)):
            check_setting(setting, getattr(self, setting.name))


def check_setting(setting: Setting, value: Any) -> None:
    try:
        msgspec.convert(value, setting.annotation)
    except msgspec.ValidationError:
        raise ConfigError(f"{setting.name} must be {setting.expected}, got {value!r}") from None


@functools.cache
def settings_of(cls: type[msgspec.Struct]) -> tuple[Setting, ...]:
    """The plain settings of a struct (nested structs excluded), in declaration order."""
    annotations = {f.name: f.type for f in msgspec.structs.fields(cls)}
    out = []
    for f in mi.type_info(cls).fields:
        info, extra = _unwrap(f.type)
        values = [t for t in (info.types if isinstance(info, mi.UnionType) else (info,))
                  if not isinstance(t, mi.NoneType)]
        if any(isinstance(t, mi.StructType) for t in values):
            continue
        optional = len(values) < (len(info.types) if isinstance(info, mi.UnionType) else 1)
        base, extra = _unwrap(values[0], extra)
        choices = _literal_values(annotations[f.name])
        default = f.default_factory() if f.default_factory is not mi.NODEFAULT else f.default
        out.append(Setting(
            name=f.name, annotation=annotations[f.name], kind=_KINDS.get(type(base), str), choices=choices,
            default=None if default is mi.NODEFAULT else default, required=f.required,
            description=extra.get("description", ""),
            expected=_expected(base, choices) + (" (or unset)" if optional else "")))
    return tuple(out)


def _literal_values(annotation: Any) -> tuple[Any, ...] | None:
    """A Literal's values in declaration order (msgspec's type info sorts them), wherever it is nested."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    for arg in typing.get_args(annotation):
        values = _literal_values(arg)
        if values is not None:
            return values
    return None


def _unwrap(info: mi.Type, extra: dict | None = None) -> tuple[mi.Type, dict]:
    """The type under any Meta annotations, and their JSON-schema extras (the description)."""
    extra = dict(extra or {})
    while isinstance(info, mi.Metadata):
        extra.update(info.extra_json_schema or {})
        info = info.type
    return info, extra


_KINDS = {mi.IntType: int, mi.FloatType: float, mi.BoolType: bool, mi.StrType: str}
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _expected(info: mi.Type, choices: tuple[Any, ...] | None) -> str:
    if choices is not None:
        return "one of " + ", ".join(str(v) for v in choices)
    what = {mi.IntType: "an integer", mi.FloatType: "a number", mi.BoolType: "true or false",
            mi.StrType: "a string"}.get(type(info), "a valid value")
    bounds = [f"{sign} {getattr(info, name)}" for name, sign in _BOUNDS if getattr(info, name, None) is not None]
    return " ".join([what, " and ".join(bounds)]).strip()
