"""Evaluation: sample k responses per problem (the engine's own generation, or the run's rollout function), score
them, report avg@k / pass@k / maj@k."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_dapo.config.run_config import DapoConfig, EvalConfig
from megatron_dapo.metrics import eval_metrics
from megatron_dapo.types import SamplingParams


def run_eval(
    rollouts,
    scorer,
    datasets: dict,
    e: EvalConfig,
    default_max_new_tokens: int,
    seed: int,
    samples_out: list | None = None,
) -> dict[str, float]:
    """``rollouts``: how samples are made (``loop/rollout_fn.py``); ``datasets``: name -> PromptDataset (one item per
    problem). Keys: ``eval/<name>/{avg,pass,maj}@k``.
    ``samples_out``: a list that receives one record per sample (problem, ground truth, response, score)."""
    records, counts = [], {}
    for name, data in datasets.items():
        sampling = SamplingParams(
            temperature=0.0 if e.greedy else e.temperature,
            top_p=1.0 if e.greedy else e.top_p,
            max_new_tokens=e.max_new_tokens or default_max_new_tokens,
            seed=seed,
        )
        items = list(data)
        groups = rollouts.stream(items, sampling, 1 if e.greedy else e.n)
        samples = sorted((s for g in groups for s in g), key=lambda s: (s.prompt_index, s.sample_index))
        results = scorer.score_batch([s.text for s in samples], [items[s.prompt_index] for s in samples])
        for s, r in zip(samples, results):
            records.append(
                {
                    "data_source": name,
                    "problem_id": s.prompt_index,
                    "pred": r.get("pred"),
                    "acc": bool(r["acc"]),
                    "valid": r.get("status") != "invalid",
                }
            )
            if samples_out is not None:
                item = items[s.prompt_index]
                samples_out.append(
                    {
                        **records[-1],
                        "sample": s.sample_index,
                        "problem": item.source,
                        "prompt": item.prompt_text,
                        "ground_truth": item.ground_truth,
                        "response": s.text,
                        "score": float(r["score"]),
                        "finish_reason": s.finish_reason,
                    }
                )
        counts.update({f"eval/{name}/problems": float(len(items)), f"eval/{name}/samples": float(len(samples))})
        # a rollout function's own numbers on this set (turns, tool calls): eval/<name>/rollout/<key>
        counts.update({f"eval/{name}/{k}": v for k, v in rollouts.metrics(reset=True).items()})
    return {**eval_metrics(records), **counts}


def evaluate_checkpoint(cfg: DapoConfig, path: str | Path, samples_out: str | Path | None = None) -> dict[str, float]:
    """Load a megatron-dapo checkpoint (any TP/PP it was saved at) and evaluate it on ``cfg.eval.files``;
    ``samples_out``: also write every scored sample there (JSONL)."""
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.checkpoint import read_meta
    from megatron_dapo.bridge.load import load_checkpoint
    from megatron_dapo.data.sources import build_eval_datasets
    from megatron_dapo.data.tokenizer import load_tokenizer
    from megatron_dapo.loop.control import broadcast, is_driver, set_control_timeout
    from megatron_dapo.loop.rollout import RolloutDriver
    from megatron_dapo.loop.rollout_fn import make_rollouts
    from megatron_dapo.models.arch import ArchConfig
    from megatron_dapo.reward.registry import RewardScorer

    set_control_timeout(cfg.rollout.control_timeout_s)
    arch = ArchConfig(**read_meta(path)["arch"])
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.hf_init)
    datasets = build_eval_datasets(cfg, tokenizer)
    actor = MegatronActor(cfg, arch)
    load_checkpoint(actor, path, load_optimizer=False)  # a LoRA run's adapters: with their base
    rollout = RolloutDriver(cfg, arch, tokenizer, Path(cfg.train.run_dir) / cfg.train.name, actor)
    rollout.sync_weights(actor, version=0)
    results, samples = None, []
    if is_driver():
        results = run_eval(
            make_rollouts(cfg, rollout.engine, tokenizer),
            RewardScorer.from_config(cfg.reward),
            datasets,
            cfg.eval,
            cfg.rollout.sampling.max_new_tokens,
            cfg.train.seed,
            samples_out=samples,
        )
        if samples_out:
            Path(samples_out).parent.mkdir(parents=True, exist_ok=True)
            Path(samples_out).write_text("".join(json.dumps(r) + "\n" for r in samples))
    rollout.close()
    return broadcast(results)
