"""Typed config trees: nested dataclasses that `--set key=value` overrides.

A graph file's config is a dataclass whose fields may be other dataclasses. `apply_overrides`
walks dotted keys, converts each value to the field's declared type and fails with a message that
names the key, the type expected and the valid choices, before anything starts.

Settings several nodes share (the policy, the staleness bound, the weight transport) are declared
once in the config's `rules` (share / fill / check, below) and resolved by Graph(config=...).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal, Union, get_args, get_origin

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
        bare = text.strip()
        try:
            items = json.loads(bare) if bare.startswith("[") else [t for t in text.split(",") if t]
        except json.JSONDecodeError:
            if not bare.endswith("]") or '"' in bare:
                raise ConfigError(f"--set {key}={text}: expected a comma-separated list or a JSON list") from None
            items = [t.strip() for t in bare[1:-1].split(",") if t.strip()]   # [a, b]: names, unquoted
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
    """Return a copy of `config` with every `key=value` of `overrides` applied (dotted keys). The
    copy is deep: building a graph from it (which fills in shared settings) leaves `config` as it was."""
    config = copy.deepcopy(config)
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


# ---- settings several nodes share ---------------------------------------------------------------
# A graph's config declares, once, which node settings follow a setting of its own:
#
#     @dataclass(kw_only=True)
#     class MyConfig:
#         policy: PolicySpec = ...
#         generator: GeneratorConfig = ...
#         learner: LearnerConfig = ...
#         rules: ClassVar[tuple[Rule, ...]] = (
#             share("policy", "generator.policy", "learner.policy"),   # one value, several places
#             fill("learner.weight_sync.dtype", lambda c: ...),       # a default computed from others
#         )
#
# Graph(config=cfg) applies them in order (resolve), in place, before the graph's nodes are declared,
# so config.json and --describe record the values that ran.


@dataclasses.dataclass(frozen=True)
class Rule:
    """One line of a config's `rules` (make them with share, fill or check)."""

    kind: str
    source: str = ""
    targets: tuple[str, ...] = ()
    compute: Callable[[Any], Any] | None = None

    def text(self) -> str:
        """How --describe / errors name the rule."""
        if self.kind == "check":
            return f"check {getattr(self.compute, '__name__', '')}"
        return f"{self.kind} {self.source or getattr(self.compute, '__name__', '?')} -> {', '.join(self.targets)}"


def share(source: str, *targets: str, value: Callable[[Any], Any] | None = None) -> Rule:
    """One setting, several places: each target (a dotted key) takes the value of `source`, or of
    `value(config)` (a value derived from `source`, e.g. a 0 meaning "what the task needs"). A target
    the user set to something else is an error naming `source`: two settings must never disagree."""
    return Rule("share", source, targets, value)


def fill(target: str, source: str | Callable[[Any], Any]) -> Rule:
    """A default taken from other settings: `target`, while left at its declared default (e.g.
    "auto"), takes the value of the setting `source`, or `source(config)`. A user's value is kept."""
    if callable(source):
        return Rule("fill", "", (target,), source)
    return Rule("fill", source, (target,))


def check(problem: Callable[[Any], str | None]) -> Rule:
    """A consistency check across settings: `problem(config)` returns what is wrong (raised as a
    ConfigError) or None. Checks run in order with the other rules, so they see filled values."""
    return Rule("check", compute=problem)


def rule_problems(cls: type) -> list[str]:
    """One line for each key of `cls.rules` (a share's or fill's source and targets) that names no
    setting of `cls`: a typo would otherwise surface only when the rule runs, or never. Reads the
    annotations, so it works on a class whose @dataclass has not run yet (__init_subclass__)."""
    found = []
    for rule in getattr(cls, "rules", ()):
        for key in ([rule.source] if rule.source else []) + list(rule.targets):
            owner = cls
            for part in key.split("."):
                hints = _setting_hints(owner)
                if part not in hints:
                    found.append(f"{cls.__name__}.rules: '{rule.text()}' names {key!r}, but "
                                 f"{getattr(owner, '__name__', owner)} has no setting {part!r}")
                    break
                owner = _unwrapped(hints[part])
    return found


def _setting_hints(owner: Any) -> dict:
    if not isinstance(owner, type):
        return {}
    try:
        return {k: v for k, v in typing.get_type_hints(owner).items() if get_origin(v) is not typing.ClassVar}
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: not a settings class here
        return {}


def _unwrapped(tp: Any) -> Any:
    """The settings class behind Annotated[...] / X | None, else tp."""
    if get_origin(tp) in (Union, types.UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        tp = options[0] if len(options) == 1 else tp
    return tp


def resolve(config: Any) -> Any:
    """Apply `type(config).rules` to `config` in place (ConfigError on a conflict); returns it."""
    for rule in getattr(type(config), "rules", ()):
        if rule.kind == "check":
            problem = rule.compute(config)
            if problem:
                raise ConfigError(problem)
            continue
        if rule.compute is not None:
            value = rule.compute(config)
        else:
            value = _lookup(config, rule.source, rule)[2]
        for target in rule.targets:
            parent, name, current = _lookup(config, target, rule)
            default = _default_of(parent, name)
            if rule.kind == "fill":
                if current == default:
                    setattr(parent, name, value)
            elif current != value and current != default:
                raise ConfigError(f"--set {target}={current!r} disagrees with {rule.source} ({value!r}), which the "
                                  f"graph shares with {', '.join(rule.targets)}: set {rule.source} instead")
            else:
                setattr(parent, name, value)
    return config


def _lookup(config: Any, key: str, rule: Rule) -> tuple[Any, str, Any]:
    """(the dataclass holding `key`, its last part, its value)."""
    *path, name = key.split(".")
    parent = config
    for part in path:
        parent = getattr(parent, part, None)
    if not dataclasses.is_dataclass(parent) or name not in field_names(parent):
        raise ConfigError(f"{type(config).__name__}.rules: '{rule.text()}' names '{key}', which is not a setting")
    return parent, name, getattr(parent, name)


def _default_of(parent: Any, name: str) -> Any:
    f = next(f for f in dataclasses.fields(parent) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING
