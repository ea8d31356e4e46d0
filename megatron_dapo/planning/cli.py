"""``dapo plan``: print the feasible parallel plans of ``megatron_dapo.planning.planner`` as a table and pick one."""

from __future__ import annotations

import argparse
import json

from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.memory import GiB
from megatron_dapo.planning.planner import plan
from megatron_dapo.planning.plans import NoFeasiblePlan, Plan, choose


def _table(plans: list[Plan], top: int):
    from rich.table import Table

    table = Table(title=f"feasible plans (best {min(top, len(plans))} of {len(plans)})")
    moe = any(p.ep > 1 for p in plans[:top])
    for col in ("#", "TP", "PP", "CP", "DP", *(("EP",) if moe else ()), "µbatch tok", "recompute", "distopt", "FP8"):
        table.add_column(col, justify="right")
    for col in ("train GiB", "resident GiB"):
        table.add_column(col, justify="right")
    for col in ("µb/update", "bubble", "step s"):
        table.add_column(col, justify="right")
    for i, p in enumerate(plans[:top]):
        cells = (i + 1, p.tp, p.pp, p.cp, p.dp, *((p.ep,) if moe else ()), p.micro_batch_tokens, p.recompute)
        cells += ("on" if p.distributed_optimizer else "off", "on" if p.fp8 else "off", f"{p.memory_gib:.1f}")
        cells += (f"{p.memory.resident / GiB:.1f}", p.micro_batches_per_update, f"{p.pipeline_bubble:.0%}")
        table.add_row(*map(str, cells + (f"{p.step_time_s:.0f}",)))
    return table


def main(argv: list[str] | None = None) -> int:
    """``dapo plan --model qwen2.5-32b --max-prompt 2048 --max-response 20480 --nodes 16 --gpus-per-node 8
    --gpu-mem 80``; exit 0 with the chosen plan, 1 when nothing fits, 2 on bad arguments."""
    ap = argparse.ArgumentParser(prog="dapo plan", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="architecture name in model_configs/ or a YAML path")
    ap.add_argument("--max-prompt", type=int, required=True)
    ap.add_argument("--max-response", type=int, required=True)
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu-mem", type=float, default=80.0, help="GiB per GPU")
    place = ap.add_mutually_exclusive_group()
    place.add_argument("--colocated", dest="colocated", action="store_true", default=True)
    place.add_argument("--disaggregated", dest="colocated", action="store_false")
    ap.add_argument("--rollout-nodes", type=int, default=None, help="disaggregated: nodes for SGLang (default half)")
    ap.add_argument("--mem-fraction", type=float, default=None, help="SGLang memory fraction (default: what is left)")
    ap.add_argument("--fp8", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--batch-prompts", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--mini-batch-prompts", type=int, default=32)
    ap.add_argument("--mean-seq-len", type=float, default=None)
    ap.add_argument("--lora-rank", type=int, default=0, help="LoRA (model.lora.rank): the base frozen; 0 = full")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="print the plans as JSON instead of tables")
    args = ap.parse_args(argv)
    fp8_options = {"auto": (False, True), "on": (True,), "off": (False,)}[args.fp8]
    keys = ("colocated", "rollout_nodes", "batch_prompts", "group_size", "mini_batch_prompts", "mean_seq_len")
    options = {k: getattr(args, k) for k in keys}
    options.update(rollout_mem_fraction=args.mem_fraction, fp8_options=fp8_options, lora_rank=args.lora_rank)
    try:
        plans = plan(
            args.model, args.max_prompt, args.max_response, args.nodes, args.gpus_per_node, args.gpu_mem, **options
        )
    except (ConfigError, ValueError) as e:
        print(f"error: {e}")
        return 2
    feasible = [p for p in plans if p.feasible]
    try:
        best = choose(plans)
    except NoFeasiblePlan as e:
        best, failure = None, str(e)
    if args.json:
        out = {"chosen": best.to_dict() if best else None, "feasible": [p.to_dict() for p in feasible[: args.top]]}
        if best is None:
            out["error"] = failure
        print(json.dumps(out, indent=1))
        return 0 if best else 1
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    if best is None:
        console.print(f"[red]no feasible plan[/red]: {failure}", markup=True, highlight=False)
        console.print(plans[0].explain() if plans else "", markup=False, highlight=False)
        return 1
    console.print(_table(feasible, args.top))
    console.print("\nchosen plan:\n" + best.explain(), markup=False, highlight=False)
    console.print("config overrides: " + " ".join(best.overrides()), markup=False, highlight=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
