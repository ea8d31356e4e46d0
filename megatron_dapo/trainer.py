"""The DAPO training loop: generate → reward → filter → advantages → train → sync → eval → save.

Every rank runs ``Trainer.run``; rank 0 drives the rollout engine and broadcasts the kept groups, every rank trains.
Transports and parallelism live behind ``RolloutDriver`` (engine + weight sync) and ``MegatronActor``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from rich.progress import track

from megatron_dapo.actor import checkpoint as ckpt
from megatron_dapo.actor.actor import MegatronActor, Sequence
from megatron_dapo.algo.sampling import DynamicSampler
from megatron_dapo.batch import Group, group_from_samples, logprob_gap_stats, to_sequences
from megatron_dapo.config import DapoConfig, load_arch, save_config
from megatron_dapo.data.dataset import PromptIterator, build_prompt_datasets
from megatron_dapo.data.tokenizer import load_tokenizer
from megatron_dapo.evaluate import run_eval
from megatron_dapo.metrics import MetricsLogger, Timer
from megatron_dapo.reward.registry import RewardScorer
from megatron_dapo.rollout.engine import SamplingParams, TokenizerInfo, check_logprob_gap


def broadcast(obj=None):
    """Rank 0's object on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def is_driver() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class RolloutDriver:
    """Rank 0 owns the rollout engine and its weight sync; every rank takes part in the (collective) export."""

    def __init__(self, cfg: DapoConfig, arch, tokenizer, run_dir: Path, actor: MegatronActor):
        self.cfg, self.arch = cfg, arch
        self.engine = self.sync = None
        model_path = cfg.model.hf_init
        if cfg.rollout.engine == "sglang" and not model_path and not cfg.rollout.server_urls:
            from megatron_dapo.bridge.export import save_hf_checkpoint

            model_path = run_dir / "sglang_init"  # a server starts from an HF directory: the actor's initial weights
            save_hf_checkpoint(actor.model, arch, model_path, tokenizer, cfg.rollout.bucket_mb << 20)  # collective
        if is_driver():
            from megatron_dapo.rollout.weight_sync import make_weight_sync

            self.engine = _make_engine(cfg, arch, tokenizer, run_dir, model_path)
            self.sync = make_weight_sync(cfg, self.engine)

    def sync_weights(self, actor: MegatronActor, version: int) -> dict[str, float]:
        from megatron_dapo.bridge.export import export_hf_tensors

        buckets = export_hf_tensors(actor.model, self.arch, self.cfg.rollout.bucket_mb << 20)
        if self.sync is None:
            for _ in buckets:  # take part in the gathers
                pass
            return {}
        return self.sync.sync(buckets, version).metrics()

    def close(self) -> None:
        """Stop the rollout servers this run started (an in-process engine has nothing to stop)."""
        if hasattr(self.sync, "close"):
            self.sync.close()
        if hasattr(self.engine, "shutdown"):
            self.engine.shutdown()


def _make_engine(cfg: DapoConfig, arch, tokenizer, run_dir: Path, model_path):
    info = TokenizerInfo.from_hf(tokenizer)
    if cfg.rollout.engine == "hf":
        from megatron_dapo.rollout.hf_engine import HFEngine

        dtype = "float32" if cfg.model.dtype == "fp32" else "bfloat16"
        return HFEngine(arch, info, dtype=dtype, max_batch=cfg.rollout.hf_max_batch, seed=cfg.train.seed)
    from megatron_dapo.rollout.sglang_engine import SGLangEngine

    return SGLangEngine.from_config(cfg, model_path, info, log_dir=run_dir / "sglang")


class Trainer:
    def __init__(self, cfg: DapoConfig, resume: str | None = None):
        self.cfg = cfg
        self.arch = load_arch(cfg.model.arch)
        self.run_dir = Path(cfg.train.run_dir) / cfg.train.name
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.hf_init)
        self.train_data, self.eval_data = build_prompt_datasets(cfg, self.tokenizer)  # fails before any compute
        self.prompts = PromptIterator(self.train_data, seed=cfg.train.seed, shuffle=cfg.data.shuffle)
        self.sampler = DynamicSampler(
            cfg.train.batch_prompts, cfg.algo.max_gen_batches, enabled=cfg.algo.dynamic_sampling
        )
        self.is_driver = is_driver()
        self.actor = MegatronActor(cfg, self.arch)
        self.start_step = self._restore(resume)
        if is_driver():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.yaml")
        self.rollout = RolloutDriver(cfg, self.arch, self.tokenizer, self.run_dir, self.actor)
        self.scorer = RewardScorer() if is_driver() else None
        self.logger = (
            MetricsLogger(self.run_dir, wandb_project=cfg.train.wandb_project, config=cfg, resume=self.start_step)
            if is_driver()
            else None
        )

    # ------------------------------------------------------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
        if self.start_step == 0 and cfg.train.supervised_warmup_steps:
            self.warm_start()
        self.rollout.sync_weights(self.actor, version=self.start_step)
        last = {}
        steps = range(self.start_step + 1, cfg.train.steps + 1)
        for step in track(steps, description="DAPO steps", disable=not is_driver() or not steps):
            times: dict[str, float] = {}
            with Timer("step", times):
                with Timer("rollout", times):
                    groups, sampling_stats = broadcast(self.collect_groups(step) if is_driver() else None)
                seqs, metrics = to_sequences(groups, cfg)
                with Timer("old_logprobs", times):
                    old, entropy = self.actor.compute_logprobs(seqs, with_entropy=True)
                for s, lp in zip(seqs, old):
                    s.old_logprobs = lp
                metrics.update(logprob_gap_stats(groups, old))
                metrics["train/entropy"] = float(torch.cat(entropy).mean())  # of the rollout policy, per token
                check_logprob_gap(metrics["train/logp_gap_mean"], cfg.rollout.logp_gap_alarm, step)
                with Timer("train", times):
                    metrics.update(self.actor.train_step(seqs))
                with Timer("sync", times):
                    metrics.update(self.rollout.sync_weights(self.actor, version=step))
                if cfg.eval.interval and step % cfg.eval.interval == 0 or step == cfg.train.steps:
                    with Timer("eval", times):
                        metrics.update(self.evaluate(step))
                if cfg.train.save_interval and step % cfg.train.save_interval == 0 or step == cfg.train.steps:
                    with Timer("save", times):
                        self.save(step)
            metrics.update({f"train/{k}": float(v) for k, v in sampling_stats.items() if not k.startswith("total_")})
            metrics.update(times)
            last = self.log(step, metrics)
        if cfg.train.export_hf and self.start_step < cfg.train.steps:
            self.export_hf(self.run_dir / "hf")
        if self.logger:
            self.logger.close()
        self.rollout.close()
        return last

    # ------------------------------------------------------------------------------------------------------------------
    def collect_groups(self, step: int) -> tuple[list[Group], dict]:
        """Rank 0: generate, score and filter groups until B are kept (dynamic sampling), aborting the surplus."""
        cfg, sampler = self.cfg, self.sampler
        engine = self.rollout.engine
        batch_index, generated = 0, []
        while not sampler.full:
            items = self.prompts.take(cfg.algo.gen_batch_prompts)
            seed = cfg.train.seed * 1_000_003 + step * 101 + batch_index
            sampling = SamplingParams.from_config(cfg.rollout.sampling, seed=seed)
            groups, correct = [], []
            for samples in engine.generate_stream([it.prompt_ids for it in items], sampling, n=cfg.algo.group_size):
                item = items[samples[0].prompt_index]
                results = self.scorer.score_batch([s.text for s in samples], [item] * len(samples))
                groups.append(group_from_samples(item.prompt_ids, samples, results, item.data_source))
                correct.append(groups[-1].correct)
                useful = sum(0 < sum(c) < len(c) for c in correct) if cfg.algo.dynamic_sampling else len(groups)
                if useful >= sampler.missing:
                    engine.abort()  # enough informative groups: drop what is still generating
                    break
            sampler.add(groups, torch.tensor(correct, dtype=torch.bool))
            generated += [c for group in correct for c in group]
            batch_index += 1
        batch = sampler.take()
        stats = sampler.stats()
        stats["kept_groups"] = stats.pop("kept")
        stats["acc_generated"] = sum(generated) / max(1, len(generated))  # before filtering (acc_mean: kept groups)
        return batch, stats

    def evaluate(self, step: int) -> dict[str, float]:
        if not is_driver():
            return {}
        max_new = self.cfg.rollout.sampling.max_new_tokens
        return run_eval(
            self.rollout.engine, self.scorer, self.eval_data, self.cfg.eval, max_new, self.cfg.train.seed + step
        )

    def warm_start(self) -> None:
        """Supervised warm start on the synthetic task (demo): NLL on " Answer: N<eos>" until held-out accuracy is
        reached or the step budget is spent."""
        from megatron_dapo.data.synthetic import supervised_target_ids

        t = self.cfg.train
        score = 0.0
        for k in range(1, t.supervised_warmup_steps + 1):
            items = self.prompts.take(t.supervised_batch)
            seqs = []
            for it in items:
                target = supervised_target_ids(self.tokenizer, it.ground_truth)
                seqs.append(Sequence(torch.tensor(it.prompt_ids + target), prompt_len=len(it.prompt_ids)))
            m = self.actor.supervised_step(seqs, lr=t.supervised_lr)
            # accuracy jumps fast once it starts: check every 10 steps from half the target on, every 20 before
            if k % (10 if score >= t.supervised_stop_acc / 2 else 20) == 0 or k == t.supervised_warmup_steps:
                self.rollout.sync_weights(self.actor, version=0)
                acc = broadcast(self.evaluate(0) if is_driver() else None)
                score = min((v for key, v in acc.items() if "/avg@" in key), default=0.0)
                self.log(0, {**m, "sft/step": k, **{f"sft/{key}": v for key, v in acc.items()}}, persist=False)
                if score >= t.supervised_stop_acc:
                    break
        self.log(0, {"sft/steps": k, **acc})  # step 0 of metrics.jsonl: where RL starts from
        self.actor.reset_optimizer_state()

    # ------------------------------------------------------------------------------------------------------------------
    def save(self, step: int) -> None:
        extra = {"prompts": self.prompts.state_dict(), "sampler": self.sampler.state_dict(), "step": step}
        self.actor.save(self.ckpt_dir / f"step_{step:06d}", extra=extra)
        if is_driver():  # keep the newest train.keep_checkpoints
            done = sorted(p for p in self.ckpt_dir.glob("step_*") if ckpt.is_complete(p))
            for old in done[: -self.cfg.train.keep_checkpoints or None] if self.cfg.train.keep_checkpoints else []:
                shutil.rmtree(old, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()

    def _restore(self, resume: str | None) -> int:
        """Load ``model.load`` / ``--resume auto|DIR``; return the step to continue after."""
        path = None
        if resume == "auto":
            done = (
                sorted(p for p in self.ckpt_dir.glob("step_*") if ckpt.is_complete(p)) if self.ckpt_dir.exists() else []
            )
            path = done[-1] if done else None
        elif resume:
            path = Path(resume)
        if path is None:
            if self.cfg.model.load:
                self.actor.load(self.cfg.model.load, load_optimizer=False)
            elif self.cfg.model.hf_init:
                from megatron_dapo.bridge.load import load_hf_into_model

                load_hf_into_model(self.actor.model, self.arch, self.cfg.model.hf_init, te=self.actor.te)
            return 0
        extra = self.actor.load(path)
        self.prompts.load_state_dict(extra["prompts"])
        self.sampler.load_state_dict(extra["sampler"])
        return int(extra["step"])

    def log(self, step: int, metrics: dict, persist: bool = True) -> dict:
        metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) or torch.is_tensor(v)}
        if is_driver():
            if persist:
                self.logger.log(step, metrics)
            keys = ("train/acc_mean", "train/reward_mean", "train/kept_groups", "sft/loss", "time/step_s")
            shown = {k: round(v, 4) for k, v in metrics.items() if k in keys or k.startswith(("eval/", "sft/eval"))}
            print(json.dumps({"step": step, **shown}), flush=True)
        return metrics

    def export_hf(self, out: Path) -> None:
        """The trained policy as an HF checkpoint (safetensors + config.json + tokenizer) that transformers loads."""
        from megatron_dapo.bridge.export import save_hf_checkpoint

        save_hf_checkpoint(self.actor.model, self.arch, out, self.tokenizer, self.cfg.rollout.bucket_mb << 20)
