"""The GPU recipes rehearsed with their step (``dapo rehearse``: one rank per pipeline stage trains once on fake
tensors, memory measured by torch), written where the docs and their test read them.

    .venv/bin/python bench/rehearse_step.py [dapo_32b dapo_qwen3_32b ...]  # 2-4 minutes each on 2 cores
    .venv/bin/python bench/rehearse_step.py --rerender                   # the docs from the stored steps (seconds)
    .venv/bin/python bench/rehearse_step.py dapo_qwen3_30b_a3b           # MoE: ~30 min (3 steps of ~15 min)

For each recipe: ``bench/results/rehearsal-<recipe>.json`` (the rehearsal, the measured steps included, the wall
time), and the block between ``<!-- rehearse:<recipe> -->`` and ``<!-- /rehearse:<recipe> -->`` in
``docs/get-started.md`` replaced by what ``dapo rehearse`` prints. ``tests/unit/test_rehearsal_docs.py`` fails when
the docs and the code's output differ (it re-renders from the stored steps with today's model, without the step).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "get-started.md"
RESULTS = REPO / "bench" / "results"
RECIPES = ("dapo_32b", "dapo_qwen3_32b", "dapo_qwen3_30b_a3b", "dapo_32b_lora")  # the docs' blocks


def docs_block(recipe: str, text: str, seconds: float, machine: str) -> str:
    """What the docs show for ``recipe``: the command's output and how long it took, measured."""
    return (
        f"<!-- rehearse:{recipe} -->\n`dapo rehearse --recipe {recipe}` took {seconds:.0f} s on {machine} "
        f"(written by `bench/rehearse_step.py`):\n\n```\n{text}\n```\n<!-- /rehearse:{recipe} -->"
    )


def replace_block(doc: str, recipe: str, block: str) -> str:
    pattern = re.compile(rf"<!-- rehearse:{recipe} -->.*?<!-- /rehearse:{recipe} -->", re.S)
    if not pattern.search(doc):
        raise SystemExit(f"docs/get-started.md has no <!-- rehearse:{recipe} --> block")
    return pattern.sub(lambda _m: block, doc)


def main(argv: list[str]) -> int:
    import os

    from megatron_dapo.config.run_config import load_config
    from megatron_dapo.planning.rehearsal import as_dict, rehearse, render

    if argv[:1] == ["--rerender"]:
        return rerender(argv[1:] or RECIPES)
    machine = f"{os.cpu_count()} CPU cores"
    for recipe in argv or RECIPES:
        cfg = load_config(recipe, [])
        t0 = time.monotonic()
        r = rehearse(cfg, cfg.cluster.nodes, cfg.cluster.gpus_per_node, recipe, step=True)
        seconds = time.monotonic() - t0
        data = {**as_dict(r), "wall_seconds": seconds, "machine": machine, "date": time.strftime("%Y-%m-%d")}
        (RESULTS / f"rehearsal-{recipe}.json").write_text(json.dumps(data, indent=1) + "\n")
        text = render(r)
        DOCS.write_text(replace_block(DOCS.read_text(), recipe, docs_block(recipe, text, seconds, machine)))
        print(f"{recipe}: {'OK' if r.ok else 'FAILED'} in {seconds:.0f} s", file=sys.stderr)
    return 0


def rerender(recipes) -> int:
    """The docs' blocks again from the stored steps with today's code (the model's side changed, not the step)."""
    from megatron_dapo.config.run_config import load_config
    from megatron_dapo.planning.rank_step import RankStep
    from megatron_dapo.planning.rehearsal import rehearse, render

    for recipe in recipes:
        stored = json.loads((RESULTS / f"rehearsal-{recipe}.json").read_text())
        steps = {int(rank): RankStep.from_dict(st) for rank, st in stored["steps"].items()}
        r = rehearse(load_config(recipe, []), stored["nodes"], stored["gpus_per_node"], recipe, measured=steps)
        r.seconds = stored["seconds"]
        block = docs_block(recipe, render(r), stored["wall_seconds"], stored["machine"])
        DOCS.write_text(replace_block(DOCS.read_text(), recipe, block))
        print(f"{recipe}: re-rendered ({'OK' if r.ok else 'FAILED'})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
