"""The repository stands alone: no tracked file reads a folder beside the checkout or a developer's own paths.

A user's clone has nothing next to it, so a test, tool, recipe or doc that refers to a sibling folder of the checkout (or
to an absolute path on one developer's machine) works here and fails there. The cluster defaults in the recipes and sbatch scripts
(``/shared/data/...``, written by ``tools/prepare_data.py``) are documented settings, not such references.
"""

import re
import subprocess

import pytest

from tests.helpers import AIME, REPO

# Built from parts so this file does not match itself.
FORBIDDEN = [
    ("a folder beside the checkout", re.compile(r"\.\./" + r"shared\b")),
    ("a developer machine's work tree", re.compile(r"(?<![\w.])/" + r"work/(main|shared)\b")),
    ("a home directory", re.compile(r"(?<![\w.])/(root|home/[a-z_][\w-]*|Users/\w+)/" + r"(?!\.cache|\.local)")),
]


def tracked_text_files():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in out.decode().split("\0"):
        path = REPO / name
        if not name or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:4096]:  # binary (parquet, png)
            continue
        yield name, data.decode("utf-8", errors="replace")


def offending_lines(files):
    found = []
    for name, text in files:
        for lineno, line in enumerate(text.splitlines(), 1):
            for what, pattern in FORBIDDEN:
                if pattern.search(line):
                    found.append(f"{name}:{lineno}: {what}: {line.strip()[:120]}")
    return found


def test_no_tracked_file_refers_outside_the_repository():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    found = offending_lines(tracked_text_files())
    assert not found, "tracked files refer to paths a user's clone does not have:\n" + "\n".join(found)


def test_the_check_catches_each_kind_of_reference():
    planted = [
        ("a.py", 'AIME = REPO.parent / "shared"  # fine\nopen("../' + 'shared/data/aime-2024.parquet")\n'),
        ("b.md", "see /" + "work/shared/SGLANG_API.md\n"),
        ("c.sh", "python /" + "root/tools/x.py\n"),
        ("d.yaml", "files: [/shared/data/aime-2024.parquet]  # a cluster default: allowed\n"),
    ]
    found = offending_lines(planted)
    assert [f.split(":")[0] for f in found] == ["a.py", "b.md", "c.sh"]


def test_the_aime_eval_set_ships_with_the_repository():
    import pyarrow.parquet as pq

    rows = pq.read_table(AIME).to_pylist()
    assert len(rows) == 960
    assert len({r["extra_info"]["index"] for r in rows}) == 30


def test_no_tracked_symlink_leaves_the_repository():
    """A symlink git tracks must point inside the checkout (a developer's ``.venv -> /elsewhere`` once got committed:
    checking it out replaced the virtual environment by a link to itself)."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-s", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    links = [entry.split("\t", 1)[1] for entry in out.decode().split("\0") if entry.startswith("120000")]
    outside = [name for name in links if not (REPO / name).resolve().is_relative_to(REPO.resolve())]
    assert not outside, f"tracked symlinks pointing outside the repository: {outside}"
