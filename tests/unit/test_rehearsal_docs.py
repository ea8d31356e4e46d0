"""The docs show what `dapo rehearse` prints: each recipe's block in docs/get-started.md is re-rendered from the steps
that `bench/rehearse_step.py` measured (bench/results/rehearsal-<recipe>.json) with today's code, without running the
step again (minutes). A change to the placement, the bridge, the planner or the memory model that the docs do not
show fails here until the bench is rerun."""

from __future__ import annotations

import json
import re

import pytest

from megatron_dapo.config.run_config import load_config
from megatron_dapo.planning.rank_step import RankStep
from megatron_dapo.planning.rehearsal import rehearse, render
from tests.helpers import REPO

DOCS = REPO / "docs" / "get-started.md"
RECIPES = ["dapo_32b", "dapo_qwen3_32b", "dapo_qwen3_30b_a3b", "dapo_32b_lora"]


def _block(recipe: str) -> str:
    m = re.search(rf"<!-- rehearse:{recipe} -->.*?```\n(.*?)\n```\n<!-- /rehearse:{recipe} -->", DOCS.read_text(), re.S)
    assert m, f"docs/get-started.md: no rehearse:{recipe} block (bench/rehearse_step.py writes it)"
    return m.group(1)


def _stored(recipe: str) -> dict:
    path = REPO / "bench" / "results" / f"rehearsal-{recipe}.json"
    if not path.exists():
        pytest.fail(f"{path.name} is missing: run bench/rehearse_step.py {recipe}")
    return json.loads(path.read_text())


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_docs_show_what_the_rehearsal_prints(recipe):
    stored = _stored(recipe)
    cfg = load_config(recipe, [])
    steps = {int(rank): RankStep.from_dict(st) for rank, st in stored["steps"].items()}
    assert steps, "the stored rehearsal ran no step"
    r = rehearse(cfg, stored["nodes"], stored["gpus_per_node"], recipe, measured=steps)
    r.seconds = stored["seconds"]
    assert render(r) == _block(recipe)
    assert r.ok == stored["ok"] and r.failures == stored["failures"]


def test_the_docs_state_the_time_measured():
    text = DOCS.read_text()
    for recipe in RECIPES:
        stored = _stored(recipe)
        assert f"`dapo rehearse --recipe {recipe}` took {stored['wall_seconds']:.0f} s on {stored['machine']}" in text
