"""Where users plug in their own code: a config value ``"package.module:function"`` or ``"path/to/file.py:function"``.

    fn = load_callable("my_rewards.math:score", key="reward.fn")

The module is imported (a file is loaded by its path, under a name derived from it, so worker processes load the same
one); dotted attributes after the colon are followed (``module:Class.method``). Every failure is a ``ConfigError``
that names the key and the value.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_dapo.config.typed_yaml import ConfigError


def _import_file(path: Path, key: str, spec: str):
    name = f"dapo_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"{key} = {spec!r}: cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_object(spec: str, key: str) -> Any:
    """The object ``spec`` names (see the module docstring)."""
    target, sep, attr = str(spec).rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(f"{key} = {spec!r}: expected 'package.module:function' or 'path/to/file.py:function'")
    try:
        if target.endswith(".py") or "/" in target:
            path = Path(target).expanduser().resolve()
            if not path.is_file():
                raise ConfigError(f"{key} = {spec!r}: no such file {path}")
            obj: Any = _import_file(path, key, spec)
        else:
            obj = importlib.import_module(target)
    except ConfigError:
        raise
    except Exception as e:  # an ImportError, or the module's own error at import
        raise ConfigError(f"{key} = {spec!r}: importing {target!r} failed: {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key} = {spec!r}: {target!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def load_callable(spec: str, key: str) -> Callable:
    fn = load_object(spec, key)
    if not callable(fn):
        raise ConfigError(f"{key} = {spec!r}: {type(fn).__name__} object is not callable")
    return fn
