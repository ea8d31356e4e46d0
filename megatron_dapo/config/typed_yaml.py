"""Plain YAML dicts into typed dataclasses, with errors that name the key and its source: what ``config.py`` (run
recipes) and ``arch.py`` (model configs) share.

    cfg = from_dict(DapoConfig, yaml_dict, "recipes/demo_cpu.yaml")   # ConfigError: "<source>: algo.eps_low = ...: ..."
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A bad configuration value; the message names the key and its source."""


# ----------------------------------------------------------------------------------------------------------------------
# Building dataclasses from plain dicts, with type checks that name the key


class BareWord(str):
    """A bare word from the command line that YAML 1.1 reads as a bool (``off``, ``yes``, ``true``...): its text for a
    string or a choice (``train.name=off``), its bool for a bool (``train.export_hf=off``)."""

    def __new__(cls, text: str, flag: bool):
        word = super().__new__(cls, text)
        word.flag = flag
        return word


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check ``value`` against the annotation ``tp`` (recursing into dataclasses and lists); return the typed value."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key, source)
            except ConfigError:
                pass
        raise ConfigError(f"{source}: {key} = {value!r}: expected {_type_name(tp)}")
    if isinstance(value, BareWord):  # a plain str or bool from here on: the config deep-copies and pickles
        value = str(value) if tp is str or (origin is Literal and str(value) in typing.get_args(tp)) else value.flag
    if origin is Literal:
        if isinstance(value, bool) and ("on" if value else "off") in typing.get_args(tp):
            value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as a bool: `tis: on` means "on"
        if value not in typing.get_args(tp):
            choices = ", ".join(repr(a) for a in typing.get_args(tp))
            raise ConfigError(f"{source}: {key} = {value!r}: must be one of {choices}")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            if isinstance(value, str):  # a single path given on the command line
                value = [value]
            else:
                raise ConfigError(f"{source}: {key} = {value!r}: expected a list")
        (item_tp,) = typing.get_args(tp)
        if item_tp is str:  # [--max-total-tokens, 8192]: YAML reads the bare number as a number; it is its text
            value = [str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in value]
        return [_coerce(v, item_tp, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if tp is dict or origin is dict:  # free-form arguments for user code (rollout.generate_args)
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} = {value!r}: expected a mapping")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} = {value!r}: expected a mapping of {tp.__name__} fields")
        return from_dict(tp, value, source, prefix=key + ".")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: {key} = {value!r}: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: {key} = {value!r}: expected an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}: {key} = {value!r}: expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{source}: {key} = {value!r}: expected a string")
        return str(value)
    raise TypeError(f"unsupported config annotation {tp!r} for {key}")


def from_dict(cls: type, data: dict, source: str, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            close = [n for n in names if n.startswith(str(key)[:3])]
            hint = f" (did you mean {', '.join(sorted(close))}?)" if close else ""
            raise ConfigError(f"{source}: {prefix}{key}: unknown key{hint}; known: {', '.join(sorted(names))}")
    kwargs = {k: _coerce(v, hints[k], prefix + k, source) for k, v in data.items()}
    return cls(**kwargs)


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"command line: {dotted}: {part} is not a section")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"algo.eps_high=0.3"`` -> ``("algo.eps_high", 0.3)``; the value is parsed as YAML (``null``, ``[a, b]``…)."""
    if "=" not in text:
        raise ConfigError(f"command line: {text!r}: expected key=value (e.g. algo.eps_high=0.3)")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"command line: {key}: cannot parse {raw!r}: {e}") from e
    if isinstance(value, bool):  # off / yes / true...: the field's type decides (a name or a flag)
        value = BareWord(raw.strip(), value)
    return key.strip(), value


def resolve_named_yaml(name_or_path: str | Path, directory: Path, what: str, known_label: str) -> Path:
    """``name_or_path`` as a YAML file: a path (``.yaml``/``.yml`` or existing), else ``directory/<name>.yaml``;
    ``ConfigError`` naming ``what`` (e.g. "recipe") and the names ``directory`` holds (as ``known_label``)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"{what} file not found: {path}")
        return path
    candidate = directory / f"{name_or_path}.yaml"
    if not candidate.is_file():
        known = ", ".join(sorted(p.stem for p in directory.glob("*.yaml")))
        raise ConfigError(f"unknown {what} {name_or_path!r}; {known_label}: {known} (or give a path to a YAML file)")
    return candidate


def read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data
