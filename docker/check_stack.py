"""Check this Python environment against requirements/gpu.txt: one line per package whose installed version differs.

    python docker/check_stack.py                          # every pin (and apex's commit, where pip recorded it)
    python docker/check_stack.py torch sglang sglang-kernel flashinfer-python   # only these
    python docker/check_stack.py --without apex           # every pin but apex
    python docker/check_stack.py --python 3.12            # this Python is 3.12, and 3.12 is one every pin accepts

Reads versions from package metadata (nothing is imported, so it runs without a GPU, e.g. while building the image).
Exit status 1 if any differs or is missing. Standard library only.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys
from pathlib import Path

GPU_TXT = Path(__file__).resolve().parent.parent / "requirements" / "gpu.txt"
# Requires-Python of the pins (pip refuses a pin whose range excludes the running Python, deep into the build):
# megatron-core 0.19: Megatron-LM core_r0.19.0 pyproject.toml:26; sglang 0.5.23: its METADATA (the pins test compares
# it with the installed one); transformer-engine 2.19.0: release_v2.19 build_tools/utils.py:25 (python_requires).
REQUIRES_PYTHON = {"megatron-core": ">=3.12", "sglang": ">=3.11", "transformer-engine": ">=3.10"}
APEX_LINE = re.compile(r"^#\s*apex @ git\+https://github\.com/NVIDIA/apex\.git@([0-9a-f]{40})\s*$")


def canonical(name: str) -> str:
    """PEP 503 name: ``flashinfer_python`` and ``Flashinfer.Python`` are ``flashinfer-python``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path = GPU_TXT) -> dict[str, str]:
    """``{canonical name: version}`` of the ``name==version`` lines, plus ``"apex": <commit>`` from its comment line."""
    pins = {}
    for line in path.read_text().splitlines():
        if m := APEX_LINE.match(line.strip()):
            pins["apex"] = m.group(1)
            continue
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
        if not m:
            raise ValueError(f"{path}: {line!r}: expected name==version")
        pins[canonical(m.group(1))] = m.group(2)
    return pins


def _apex_commit(dist: importlib.metadata.Distribution) -> str | None:
    """The commit pip recorded for a VCS install (PEP 610 direct_url.json), if any."""
    text = dist.read_text("direct_url.json")
    return json.loads(text).get("vcs_info", {}).get("commit_id") if text else None


def problems(pins: dict[str, str], only: list[str] | None = None, without: tuple[str, ...] = ()) -> list[str]:
    out = []
    skip = {canonical(n) for n in without}
    for name in [n for n in ([canonical(n) for n in only] if only else sorted(pins)) if n not in skip]:
        if name not in pins:
            out.append(f"{name}: not pinned in {GPU_TXT.name}")
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{name}: not installed (want {pins[name]})")
            continue
        if name == "apex":
            commit = _apex_commit(dist)
            if commit not in (None, pins[name]):
                out.append(f"apex: built from commit {commit}, want {pins[name]}")
        elif dist.version.split("+", 1)[0] != pins[name]:  # a local tag (+cu130) is the same release
            out.append(f"{name}: {dist.version} installed, want {pins[name]}")
    return out


def _version(text: str) -> tuple[int, ...]:
    parts = tuple(int(p) for p in text.split("."))
    return parts + (0,) * (3 - len(parts))


def python_problems(version: str, requires: dict[str, str] = REQUIRES_PYTHON) -> list[str]:
    """The pins whose Requires-Python (``>=``, ``>``, ``<=``, ``<``, ``==``, ``!=`` clauses) excludes ``version``."""
    ops = {">=": tuple.__ge__, "<=": tuple.__le__, "==": tuple.__eq__, "!=": tuple.__ne__, ">": tuple.__gt__,
           "<": tuple.__lt__}  # fmt: skip
    out = []
    for name, spec in sorted(requires.items()):
        for clause in (c.strip() for c in spec.split(",")):
            op = next(o for o in ops if clause.startswith(o))
            if not ops[op](_version(version), _version(clause[len(op) :])):
                out.append(f"python {version}: {name} requires Python {spec}")
    return out


def check_python(want: str, running: str | None = None) -> list[str]:
    """``want`` (the image's ARG PYTHON_VERSION, major.minor) is the running Python's and one every pin accepts."""
    running = running or ".".join(map(str, sys.version_info[:3]))
    out = python_problems(want)
    if running.split(".")[:2] != want.split(".")[:2]:
        out.append(f"python {running} runs here, the pins were chosen for Python {want} (docker/Dockerfile "
                   "ARG PYTHON_VERSION): use a base image with that Python")  # fmt: skip
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--python"]:
        bad = check_python(argv[1])
        for line in bad:
            print(f"check_stack: {line}", file=sys.stderr)
        if not bad:
            print(f"check_stack: Python {argv[1]}, as every pin requires ({REQUIRES_PYTHON})")
        return 1 if bad else 0
    without = tuple(argv[argv.index("--without") + 1 :]) if "--without" in argv else ()
    only = argv[: argv.index("--without")] if "--without" in argv else argv
    bad = problems(read_pins(), only or None, without)
    for line in bad:
        print(f"check_stack: {line}", file=sys.stderr)
    if not bad:
        what = ", ".join(only) or "every pin" + (f" but {', '.join(without)}" if without else "")
        print(f"check_stack: {what} as in requirements/gpu.txt")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
