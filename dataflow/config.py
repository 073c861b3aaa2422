"""Typed config trees: nested dataclasses that `--set key=value` overrides.

A graph file's config is a dataclass whose fields may be other dataclasses. `apply_overrides`
walks dotted keys, converts each value to the field's declared type and fails with a message that
names the key, the type expected and the valid choices, before anything starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from dataflow.errors import ConfigError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE = {"none", "null"}


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _resolved_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # forward refs we cannot resolve: fall back to the raw annotations
        return {f.name: f.type for f in dataclasses.fields(cls)}


def convert(text: str, tp: Any, key: str) -> Any:
    """Convert a --set string to type `tp`; raise ConfigError naming `key` if it does not fit."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        if type(None) in args and text.strip().lower() in _NONE:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return convert(text, option, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"--set {key}={text}: expected {_type_name(tp)}")
    if origin is Literal:
        for choice in args:
            if str(choice) == text:
                return choice
        raise ConfigError(f"--set {key}={text}: choose one of {', '.join(map(str, args))}")
    if tp is bool:
        low = text.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError(f"--set {key}={text}: expected a bool (true/false)")
    if tp is int:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            raise ConfigError(f"--set {key}={text}: expected an integer") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"--set {key}={text}: expected a number") from None
    if tp in (str, Any):
        return text
    if tp is Path:
        return Path(text)
    if origin in (list, tuple) or tp in (list, tuple):
        try:
            items = json.loads(text) if text.strip().startswith("[") else [t for t in text.split(",") if t]
        except json.JSONDecodeError:
            raise ConfigError(f"--set {key}={text}: expected a comma-separated list or a JSON list") from None
        inner = args[0] if args else str
        values = [convert(str(v), inner, key) for v in items]
        return tuple(values) if origin is tuple else values
    if origin is dict or tp is dict:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, dict):
            raise ConfigError(f"--set {key}={text}: expected a JSON object, e.g. '{{\"a\": 1.0}}'")
        return value
    if dataclasses.is_dataclass(tp):
        raise ConfigError(f"--set {key}: '{key}' is a group of settings; set one of its fields, e.g. {key}.<field>=...")
    raise ConfigError(f"--set {key}={text}: settings of type {_type_name(tp)} cannot be set from the command line")


def field_names(config: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(config)]


def apply_overrides(config: Any, overrides: list[str]) -> Any:
    """Return a copy of `config` with every `key=value` of `overrides` applied (dotted keys)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item}: expected key=value, e.g. --set learner.lr=1e-5")
        key, text = item.split("=", 1)
        config = _set(config, key.strip().split("."), text, key.strip())
    return config


def _set(node: Any, path: list[str], text: str, full_key: str) -> Any:
    if not dataclasses.is_dataclass(node):
        raise ConfigError(f"--set {full_key}: '{'.'.join(full_key.split('.')[:-len(path)])}' has no sub-settings")
    name = path[0]
    names = field_names(node)
    if name not in names:
        prefix = full_key[: len(full_key) - len(".".join(path))]
        close = difflib.get_close_matches(name, names, n=3)
        hint = f" Did you mean {', '.join(prefix + c for c in close)}?" if close else ""
        raise ConfigError(
            f"--set {full_key}: unknown setting '{prefix}{name}'.{hint} "
            f"Settings here: {', '.join(prefix + n for n in names)}. (--describe lists them all)"
        )
    current = getattr(node, name)
    if len(path) == 1:
        value = convert(text, _resolved_hints(type(node))[name], full_key)
    else:
        value = _set(current, path[1:], text, full_key)
    try:
        return dataclasses.replace(node, **{name: value})
    except (ValueError, TypeError) as e:  # the config's own __post_init__ checks
        raise ConfigError(f"--set {full_key}={text}: {e}") from None


def flatten(config: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """[(dotted key, value)] of every leaf setting, for --describe and the metrics header."""
    rows = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            rows += flatten(value, f"{prefix}{f.name}.")
        else:
            rows.append((f"{prefix}{f.name}", value))
    return rows
