"""Where users plug in their own code: a config value ``"package.module:function"`` or ``"path/to/file.py:function"``.

    fn = load_callable("my_rewards.math:score", key="reward.fn")

The module is imported (a file is loaded by its path, under a name derived from it, so worker processes load the same
one); dotted attributes after the colon are followed (``module:Class.method``). Every failure is a ``ConfigError``
that names the key and the value; a module that raises or calls ``sys.exit()`` while imported is one too, naming its
file and line.
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


def _import_site(e: BaseException, path: Path | None, target: str) -> str:
    """Where an import failed: the module's file, and the line in it that raised or exited when the traceback has it."""
    if path is None:
        try:
            found = importlib.util.find_spec(target)
            path = Path(found.origin) if found is not None and found.origin else None
        except Exception:  # noqa: BLE001 - a parent package that itself fails to import
            path = None
    if path is None:
        return "file unknown"
    line = None
    tb = e.__traceback__
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename) == path:
            line = tb.tb_lineno
        tb = tb.tb_next
    return f"{path}, line {line}" if line else str(path)


def load_object(spec: str, key: str) -> Any:
    """The object ``spec`` names (see the module docstring)."""
    target, sep, attr = str(spec).rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(f"{key} = {spec!r}: expected 'package.module:function' or 'path/to/file.py:function'")
    path: Path | None = None
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
    except (Exception, SystemExit) as e:  # not found, the module's own error, or its sys.exit() at import
        if isinstance(e, ModuleNotFoundError) and e.name and (target == e.name or target.startswith(e.name + ".")):
            raise ConfigError(f"{key} = {spec!r}: importing {target!r} failed: {type(e).__name__}: {e}") from e
        what = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"raised {type(e).__name__}: {e}"
        raise ConfigError(
            f"{key} = {spec!r}: importing {target!r} failed: the module ({_import_site(e, path, target)}) {what}"
        ) from e
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
