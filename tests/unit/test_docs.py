"""The docs cannot rot: README.md's size, every relative link, and the commands the docs show.

Pages: README.md and docs/**/*.md. The commands are parsed from their fenced ``bash`` blocks, never listed here:

* ``dapo SUB ...`` (also ``.venv/bin/dapo``, ``torchrun ... -m megatron_dapo.cli SUB ...``): the subcommand must exist.
  What runs on a CPU in about a second runs as shown (``dapo plan``, ``dapo launch --dry-run``); the rest runs in its
  ``--help`` form, for the reason in ``HELP_ONLY``. A recipe named by ``--recipe`` must load with the overrides shown
  (``load_config``: keys, values and the validation a run starts with, no training).
* ``make TARGET``: the target must be in the Makefile. ``python FILE`` and ``sbatch FILE``: the file must exist.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_LIMIT = 10_000  # characters
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]

# Subcommands shown in the docs that must not run in full here, and why; they run as ``dapo SUB --help``.
HELP_ONLY = {
    "train": "trains for minutes",
    "eval": "needs a checkpoint",
    "report": "needs a finished run's metrics.jsonl",
    "convert": "needs a checkpoint to convert",
    "rehearse": "builds all ranks of a GPU job and trains one per stage on fake tensors: minutes on 2 cores",
    "launch": "needs a Slurm allocation (without --dry-run)",
}
RUN_IN_FULL = {"plan": "the planner, under a second on a CPU"}  # and any command with --dry-run
KEEP_ACTION = {"convert"}  # ``dapo convert hf-to-megatron --help``: the direction is checked too
RUN_TIMEOUT_S = 120

FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)[^\n]*\n(.*?)^\1\s*$", re.M | re.S)
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"`+[^`\n]*`+")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if ROOT in path.parents else str(path)


def _without_code(text: str) -> str:
    """The page's prose: fenced blocks and inline code removed (a link inside them is not a link)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return INLINE_CODE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(FENCE.sub("", page.read_text())):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` whose file (or heading anchor, in a Markdown file) does not exist."""
    problems = []
    for m in LINK.finditer(_without_code(page.read_text())):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            problems.append(f"{_rel(page)}: ({target}): no such file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{_rel(page)}: ({target}): no heading with anchor #{anchor} in {_rel(dest)}")
    return problems


def shell_lines(page: Path) -> list[str]:
    """The command lines of the page's fenced shell blocks, continuation lines joined."""
    lines = []
    for m in FENCE.finditer(page.read_text()):
        if m.group(2).lower() not in SHELL_BLOCKS:
            continue
        pending = ""
        for raw in m.group(3).splitlines():
            if raw.rstrip().endswith("\\"):
                pending += raw.rstrip()[:-1] + " "
                continue
            line = (pending + raw).strip()
            pending = ""
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def words(line: str) -> list[str]:
    """The line's words, comments cut off, leading ``VAR=value`` assignments dropped."""
    toks = shlex.split(line, comments=True)
    while toks and ENV_ASSIGN.match(toks[0]):
        toks.pop(0)
    return toks


def dapo_args(toks: list[str]) -> list[str] | None:
    """The arguments after ``dapo`` (or ``-m megatron_dapo.cli``), or None when the line runs something else."""
    if toks and (toks[0] == "dapo" or toks[0].endswith("/dapo")):
        return toks[1:]
    if "-m" in toks:
        i = toks.index("-m")
        if i + 1 < len(toks) and toks[i + 1] == "megatron_dapo.cli":
            return toks[i + 2 :]
    return None


@dataclass(frozen=True)
class Shown:
    page: str
    line: str
    args: tuple[str, ...]

    @property
    def sub(self) -> str | None:
        return self.args[0] if self.args and not self.args[0].startswith("-") else None

    def run_form(self) -> tuple[tuple[str, ...], str]:
        """What the test runs and why that form."""
        if self.sub is None:
            return self.args, "dapo's own options"
        if "--dry-run" in self.args:
            return self.args, "--dry-run: the plan only, no Slurm or GPU"
        if self.sub in RUN_IN_FULL:
            return self.args, RUN_IN_FULL[self.sub]
        head = [self.sub]
        if self.sub in KEEP_ACTION and len(self.args) > 1 and not self.args[1].startswith("-"):
            head.append(self.args[1])
        return (*head, "--help"), HELP_ONLY.get(self.sub, "a subcommand the docs show: its --help must exit 0")

    def recipe(self) -> tuple[str, list[str]] | None:
        """``--recipe NAME`` and the ``key=value`` overrides, for the subcommands that load a config from them."""
        if self.sub not in ("train", "rehearse", "launch") or "--recipe" not in self.args:
            return None
        i = self.args.index("--recipe")
        rest = [a for a in self.args[1:] if "=" in a and not a.startswith("-") and "." in a.split("=", 1)[0]]
        return self.args[i + 1], rest


def shown_commands() -> list[Shown]:
    out = []
    for page in PAGES:
        for line in shell_lines(page):
            args = dapo_args(words(line))
            if args is not None:
                out.append(Shown(_rel(page), line, tuple(args)))
    return out


def other_commands(program: str) -> list[tuple[str, list[str]]]:
    out = []
    for page in PAGES:
        for line in shell_lines(page):
            toks = words(line)
            if toks and Path(toks[0]).name.startswith(program):
                out.append((_rel(page), toks))
    return out


def run_dapo(args: tuple[str, ...] | list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # a dry run outside any allocation
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(
        [sys.executable, "-m", "megatron_dapo.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )


SHOWN = shown_commands()
FORMS = sorted({s.run_form() for s in SHOWN})
RECIPES = sorted({(s.page, s.line): s for s in SHOWN if s.recipe()}.values(), key=lambda s: (s.page, s.line))


# ----------------------------------------------------------------------------------------------------------------------
# Size and links


def test_readme_is_short():
    n = len(README.read_text())
    assert n <= README_LIMIT, f"README.md has {n} characters, over {README_LIMIT}: move detail to docs/"


def test_readme_keeps_the_two_commands():
    commands = [words(line) for line in shell_lines(README)]
    assert ["make", "demo"] in commands and ["make", "test"] in commands


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_every_page_is_reachable_from_the_readme():
    """Every docs page is linked from README.md or from a page the README reaches."""
    reached, todo = set(), [README]
    while todo:
        page = todo.pop()
        if page in reached:
            continue
        reached.add(page)
        for m in LINK.finditer(_without_code(page.read_text())):
            target = m.group(1).partition("#")[0]
            if target and not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                dest = (page.parent / target).resolve()
                if dest.suffix == ".md" and dest.is_file() and ROOT in dest.parents:
                    todo.append(dest)
    assert [_rel(p) for p in PAGES if p not in reached] == []


def test_the_link_check_fails_on_a_broken_link(tmp_path):
    (tmp_path / "real.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](real.md) [ok too](real.md#a-heading) [web](https://example.com) `[code](nowhere.md)`\n"
        "```\n[in a block](nowhere.md)\n```\n[gone](missing.md) [bad anchor](real.md#no-such-heading)\n"
    )
    problems = broken_links(page)
    assert len(problems) == 2 and "missing.md" in problems[0] and "no-such-heading" in problems[1]


# ----------------------------------------------------------------------------------------------------------------------
# The commands the docs show


def test_the_docs_show_dapo_commands():
    """The parser finds what the pages show (a parser that finds nothing would pass everything)."""
    assert {s.sub for s in SHOWN} >= {"train", "eval", "report", "convert", "plan", "launch", "rehearse"}


@pytest.mark.parametrize("form,why", FORMS, ids=[" ".join(f) for f, _ in FORMS])
def test_shown_dapo_command_runs(form, why):
    shown_on = sorted({f"{s.page}: {s.line}" for s in SHOWN if s.run_form() == (form, why)})
    r = run_dapo(form)
    assert r.returncode == 0, (
        f"`dapo {' '.join(form)}` ({why}) exited {r.returncode}; shown at\n  "
        + "\n  ".join(shown_on)
        + f"\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    )


@pytest.mark.parametrize("shown", RECIPES, ids=[f"{s.page}: dapo {' '.join(s.args)}"[:100] for s in RECIPES])
def test_shown_recipe_and_overrides_load(shown):
    from megatron_dapo.config.run_config import load_config

    recipe, overrides = shown.recipe()
    load_config(recipe, overrides)  # raises ConfigError naming the key or the recipe


def test_an_unknown_subcommand_fails():
    """What a renamed subcommand in the docs would run: ``dapo NAME --help`` must not exit 0."""
    form, _ = Shown("x.md", "dapo no-such-subcommand --flag", ("no-such-subcommand", "--flag")).run_form()
    assert run_dapo(form).returncode != 0


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"^([A-Z_]+)\s*[?:]?=\s*(\S+)\s*$", text, re.M))
    targets = set()
    for m in re.finditer(r"^([^\s#=:][^=:]*?):(?!=)", text, re.M):
        for name in m.group(1).split():
            targets.add(re.sub(r"\$\((\w+)\)", lambda v: variables.get(v.group(1), v.group(0)), name))
    return {t.replace("$(VENV)", variables.get("VENV", ".venv")) for t in targets}


def test_shown_make_targets_exist():
    targets = _make_targets()
    missing = [
        f"{page}: make {tok}"
        for page, toks in other_commands("make")
        for tok in toks[1:]
        if not tok.startswith("-") and "=" not in tok and tok not in targets
    ]
    assert missing == []


def test_shown_scripts_exist():
    missing = []
    for program in ("python", "sbatch"):
        for page, toks in other_commands(program):
            script = next((t for t in toks[1:] if not t.startswith("-")), None)
            if toks[1:2] == ["-m"] or script is None:
                continue
            if not (ROOT / script).exists():
                missing.append(f"{page}: {' '.join(toks)}")
    assert missing == []
