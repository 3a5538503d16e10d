"""Typed dataclass configs: build them from plain dicts (YAML), apply ``key.sub=value``
overrides, and turn them back into dicts.

Every dataclass used as a config section may define ``validate(self, prefix: str)``; it is
called after the section is built and raises :class:`fpscale.errors.ConfigError` naming the key.
A dataclass annotation may stand for a tagged union: a classmethod ``select(data, key)`` returns
the dataclass to build from ``data`` (``model.layers`` entries pick their layer type's class).
Nothing here knows about any particular section.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from fpscale.errors import ConfigError


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _join(prefix: str, key: str | int) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and return it in that type."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(key, f"expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(key, f"must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
        return value
    if origin in (list, tuple):
        (item_tp, *_) = get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"expected a list, got {value!r}")
        items = [_coerce(v, item_tp, _join(key, i)) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        _, val_tp = get_args(tp) or (str, Any)
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {value!r}")
        return {str(k): _coerce(v, val_tp, _join(key, k)) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping of {tp.__name__} fields, got {value!r}")
        select = getattr(tp, "select", None)
        return from_dict(select(value, key) if select is not None else tp, value, key)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):   # PyYAML reads 1e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config annotation {tp!r} for {key}")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(cls: type, data: dict[str, Any] | None, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types name the key."""
    data = dict(data or {})
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            close = ([f for f in fields if f.startswith(str(key)) or str(key).startswith(f)]
                     or difflib.get_close_matches(str(key), list(fields), n=1))
            hint = f" (did you mean '{_join(prefix, close[0])}'?)" if close else ""
            raise ConfigError(_join(prefix, key), f"unknown key for {cls.__name__}{hint}; "
                              f"known keys: {', '.join(fields)}")
    kwargs = {}
    for name, field in fields.items():
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], _join(prefix, name))
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(_join(prefix, name), "is required")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(prefix)
    return obj


def to_dict(obj: Any) -> Any:
    """Plain-data view of a config (dataclasses -> dicts), safe for YAML/JSON."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one ``a.b.c=value`` override in place; ``value`` is parsed as YAML.

    List entries are addressed by index (``model.layers.1.type=fpsa``). Whether the key
    exists is checked when the config is built, so a typo is reported with suggestions.
    """
    if "=" not in override:
        raise ConfigError(override, "an override must look like key.sub=value")
    path, raw = override.split("=", 1)
    path = path.strip()
    if not path:
        raise ConfigError(override, "an override needs a key before '='")
    value = yaml.safe_load(raw) if raw.strip() else ""
    parts = path.split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        where = ".".join(parts[: i + 1])
        if isinstance(node, list):
            node = node[_index(node, part, where)]
            continue
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, (dict, list)):
            raise ConfigError(where, f"is a value ({node!r}), it has no sub-keys")
    last = parts[-1]
    if isinstance(node, list):
        node[_index(node, last, path)] = value
    else:
        node[last] = value


def _index(items: list, part: str, where: str) -> int:
    if not part.lstrip("-").isdigit() or not -len(items) <= int(part) < len(items):
        raise ConfigError(where, f"is a list of {len(items)} entries; '{part}' is not a valid index")
    return int(part)


def load_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except FileNotFoundError:
        raise ConfigError("--config", f"file not found: {path}") from None
    except yaml.YAMLError as exc:
        raise ConfigError("--config", f"{path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("--config", f"{path} must hold a mapping at the top level")
    return data
