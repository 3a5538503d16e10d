"""Typed dataclass configs: build them from plain dicts (YAML), apply ``key.sub=value``
overrides, and turn them back into dicts.

Every dataclass used as a config section may define ``validate(self, prefix: str)``; it is
called after the section is built and raises :class:`fpscale.errors.ConfigError` naming the key.
A dataclass annotation may stand for a tagged union: a classmethod ``select(data, key)`` returns
the dataclass to build from ``data`` (``model.layers`` entries pick their layer type's class).
A dataclass whose keys moved defines a classmethod ``upgrade(data, key)`` that rewrites data in the
older form before it is built (``nest``: flat keys into sub-sections, one ``ConfigDeprecation`` per
key naming the new one); ``upgrade_data`` runs every hook of a config tree on plain data, so a
loader can bring the YAML to today's form before it merges the overrides in (the later word wins).
Nothing here knows about any particular section.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import types
import typing
import warnings
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from fpscale.errors import ConfigDeprecation, ConfigError


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


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unknown(owner: str, key: Any, known: dict[str, str], listed: list[str], prefix: str) -> ConfigError:
    """The error for an unknown ``key``: the closest of ``known`` (name -> its full path under prefix)."""
    close = ([k for k in known if k.startswith(str(key)) or str(key).startswith(k)]
             or difflib.get_close_matches(str(key), list(known), n=1))
    hint = f" (did you mean '{_join(prefix, known[close[0]])}'?)" if close else ""
    return ConfigError(_join(prefix, key), f"unknown key for {owner}{hint}; known keys: {', '.join(listed)}")


def from_dict(cls: type, data: dict[str, Any] | None, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types name the key."""
    data = dict(data or {})
    upgrade = getattr(cls, "upgrade", None)
    if upgrade is not None:
        data = upgrade(data, prefix)
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            raise _unknown(cls.__name__, key, {f: f for f in fields}, list(fields), prefix)
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


def nest(data: dict[str, Any], parts: dict[str, str], prefix: str, owner: str | None = None,
         warn: bool = True) -> dict[str, Any]:
    """``data`` with each flat key of ``parts`` (name -> its sub-section) moved into its sub-section, one
    ``ConfigDeprecation`` per key naming the new key (``warn``). A flat key wins over the same key already
    nested: it is the later word (an override ``solver.tol=...`` over a nested YAML; ``upgrade_data`` brings
    the YAML to the nested form before the overrides apply). A nested key in another sub-section is refused
    naming both keys; with ``owner`` (the class the sections make up) so is any other unknown key."""
    sections = list(dict.fromkeys(parts.values()))
    out = {k: dict(v) if k in sections and isinstance(v, dict) else v for k, v in data.items()}
    for name in [k for k in data if k in parts]:
        section, new = parts[name], _join(prefix, f"{parts[name]}.{name}")
        if not isinstance(out.setdefault(section, {}), dict):
            raise ConfigError(_join(prefix, section), f"expected a mapping, got {out[section]!r}")
        out[section][name] = out.pop(name)
        if warn:
            warnings.warn(ConfigDeprecation(f"config key '{_join(prefix, name)}' is now '{new}': the flat key "
                                             f"loads, the nested one is the form to write"), stacklevel=3)
    for section in sections:
        sub = out.get(section)
        for name in sub if isinstance(sub, dict) else ():
            if parts.get(name, section) != section:
                raise ConfigError(_join(prefix, f"{section}.{name}"), f"belongs to {parts[name]}: write "
                                  f"'{_join(prefix, f'{parts[name]}.{name}')}'")
    unknown = [key for key in out if key not in sections]
    if owner is not None and unknown:
        known = {**{s: s for s in sections}, **{n: f"{s}.{n}" for n, s in parts.items()}}
        raise _unknown(owner, unknown[0], known, sections, prefix)
    return out


def upgrade_data(cls: type, data: Any, prefix: str = "") -> Any:
    """Plain ``data`` for dataclass ``cls`` with the ``upgrade`` hook of ``cls`` and of every dataclass under
    it applied (a new dict; what does not parse is left for ``from_dict`` to report)."""
    if not isinstance(data, dict):
        return data
    select = getattr(cls, "select", None)
    if select is not None:
        try:
            cls = select(data, prefix)
        except ConfigError:
            return data
    upgrade = getattr(cls, "upgrade", None)
    data = upgrade(data, prefix) if upgrade is not None else dict(data)
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in data:
            data[f.name] = _upgrade_value(data[f.name], hints[f.name], _join(prefix, f.name))
    return data


def _upgrade_value(value: Any, tp: Any, key: str) -> Any:
    if get_origin(tp) in (Union, types.UnionType):
        inner = [a for a in get_args(tp) if dataclasses.is_dataclass(a)]
        return _upgrade_value(value, inner[0], key) if inner else value
    if get_origin(tp) in (list, tuple) and isinstance(value, list):
        item = (get_args(tp) or (Any,))[0]
        return [_upgrade_value(v, item, _join(key, i)) for i, v in enumerate(value)]
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return upgrade_data(tp, value, key)
    return value


def merge(base: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """``data`` over ``base``: mappings merge key by key, anything else (lists too) replaces."""
    out = dict(base)
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


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
