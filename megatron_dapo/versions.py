"""The versions of the stack this project supports: one constant per package, read by the start-up preflight
(``launch/preflight.py``) and the install files' tests.

    in_range("0.19.2", MCORE_RANGE)   # True
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

# megatron-core: the actor runs on 0.16.1 and on the newest release (0.19.2); pyproject.toml pins the same range
MCORE_RANGE = ">=0.16.1,<0.20"


def in_range(version: str, spec: str) -> bool:
    """``version`` satisfies ``spec`` (``">=0.16.1,<0.20"``) as pip reads it (PEP 440, by ``packaging``, which
    megatron-core itself requires): a pre-release counts below its release (``0.16.1rc1`` is not in ``>=0.16.1``),
    a local tag (``+cu12``) is ignored, and a pre-release inside the range is accepted (a source build's ``.dev0``)."""
    try:
        parsed = Version(version.strip())
    except InvalidVersion as e:
        raise ValueError(f"not a version: {version!r}") from e
    return SpecifierSet(spec, prereleases=True).contains(parsed)
