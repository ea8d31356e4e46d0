"""Check this Python environment against requirements/gpu.txt: one line per package whose installed version differs.

    python docker/check_stack.py                          # every pin (and apex's commit, where pip recorded it)
    python docker/check_stack.py torch sglang sglang-kernel flashinfer-python   # only these
    python docker/check_stack.py --without apex           # every pin but apex

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


def main(argv: list[str]) -> int:
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
