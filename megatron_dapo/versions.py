"""The versions of the stack this project supports: one constant per package, read by the start-up preflight
(``preflight.py``) and the install files' tests.

    in_range("0.19.2", MCORE_RANGE)   # True
"""

from __future__ import annotations

import re

# megatron-core: the actor runs on 0.16.1 and on the newest release (0.19.2); pyproject.toml pins the same range
MCORE_RANGE = ">=0.16.1,<0.20"

_OPS = {">=": lambda a, b: a >= b, "<": lambda a, b: a < b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b,
        "==": lambda a, b: a == b}  # fmt: skip


def release(version: str) -> tuple[int, ...]:
    """``"0.19.2rc1+cu12"`` -> ``(0, 19, 2)``: the release numbers (pre-releases and local tags count as that release)."""
    m = re.match(r"\d+(\.\d+)*", version.strip())
    if not m:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(p) for p in m.group(0).split("."))


def in_range(version: str, spec: str) -> bool:
    """``version`` satisfies every clause of ``spec`` (``">=0.16.1,<0.20"``); releases compared padded with zeros."""
    have = release(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op = next(o for o in (">=", "<=", "==", ">", "<") if clause.startswith(o))
        want = release(clause[len(op) :])
        n = max(len(have), len(want))
        if not _OPS[op](have + (0,) * (n - len(have)), want + (0,) * (n - len(want))):
            return False
    return True
