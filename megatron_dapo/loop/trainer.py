"""The DAPO training loop: generate → reward → filter → advantages → train → sync → eval → save.

Every rank runs ``Trainer.run``; rank 0 drives the rollout engine and broadcasts the kept groups, every rank trains.
Transports and parallelism live behind ``RolloutDriver`` (engine + weight sync, ``loop/rollout.py``) and
``MegatronActor``.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.progress import track

from megatron_dapo import runs
from megatron_dapo.actor import checkpoint as ckpt
from megatron_dapo.actor.actor import MegatronActor
from megatron_dapo.algo.batch import logprob_gap_stats, policy_entropy
from megatron_dapo.algo.sampling import DynamicSampler
from megatron_dapo.config.plugins import load_callable
from megatron_dapo.config.run_config import DapoConfig, save_config
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.data.dataset import PromptIterator
from megatron_dapo.data.sources import build_prompt_datasets
from megatron_dapo.data.tokenizer import load_tokenizer
from megatron_dapo.engines.base import check_logprob_gap
from megatron_dapo.engines.registry import DEFAULT_ENGINE, engine_spec
from megatron_dapo.loop.control import (  # noqa: F401  (DriverError: this module's API since it began)
    DriverError,
    broadcast,
    is_driver,
    on_driver,
    scatter_batch,
    set_control_timeout,
)
from megatron_dapo.loop.evaluate import run_eval
from megatron_dapo.loop.phases import make_phases
from megatron_dapo.loop.rollout import RolloutDriver
from megatron_dapo.loop.rollout_fn import make_rollouts
from megatron_dapo.loop.schedule import make_schedule
from megatron_dapo.loop.updates import make_updates
from megatron_dapo.metrics import MetricsLogger, Timer, memory_metrics
from megatron_dapo.models.arch import load_arch
from megatron_dapo.reward.registry import RewardScorer
from megatron_dapo.types import Sequence


def prepare_model_and_engine(cfg: DapoConfig) -> None:
    """``model.hf_init = gguf:...`` becomes its cached HF directory (``gguf.resolve_hf_dir``, built once); with
    ``rollout.fallback_hf`` and no sglang installed, the HF engine generates instead (said here, at start)."""

    from megatron_dapo.models.gguf import resolve_hf_dir

    log = (lambda s: print(f"model: {s}", flush=True)) if is_driver() else (lambda s: None)
    cfg.model.hf_init = resolve_hf_dir(cfg.model.hf_init, log)
    r = cfg.rollout
    spec = engine_spec(r.engine)
    package = spec.package
    if package and r.fallback_hf and not spec.installed(cfg):
        if is_driver():
            print(
                f"rollout: {package} is not installed: the in-process HF engine generates instead "
                "(rollout.fallback_hf; `make demo-smollm` installs sglang)",
                flush=True,
            )
        r.engine, r.weight_sync = DEFAULT_ENGINE, "copy"


class Trainer:
    def __init__(self, cfg: DapoConfig, resume: str | None = "auto", stop: runs.StopRequest | None = None):
        self.cfg = cfg
        prepare_model_and_engine(cfg)
        set_control_timeout(cfg.rollout.control_timeout_s)  # what the other ranks wait on while rank 0 works
        self.arch = load_arch(cfg.model.arch)
        if cfg.model.hf_init:  # an HF checkpoint of another architecture: an error now, not after building the model
            from megatron_dapo.models.hf_config import check_hf_dir

            check_hf_dir(self.arch, cfg.model.hf_init)
        self.run_dir = Path(cfg.train.run_dir) / cfg.train.name
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.hf_init)
        self.train_data, self.eval_data = build_prompt_datasets(cfg, self.tokenizer)  # fails before any compute
        cut = {name: ds.num_truncated for name, ds in {"train": self.train_data, **self.eval_data}.items()}
        if any(cut.values()) and is_driver():
            print(
                f"data: prompts longer than data.max_prompt_len = {cfg.data.max_prompt_len} tokens, cut from the "
                f"left: {', '.join(f'{n} of {name}' for name, n in cut.items() if n)}",
                flush=True,
            )
        self.prompts = PromptIterator(self.train_data, seed=cfg.train.seed, shuffle=cfg.data.shuffle)
        self.sampler = DynamicSampler(
            cfg.train.batch_prompts, cfg.algo.max_gen_batches, enabled=cfg.algo.dynamic_sampling
        )
        self.stop = stop or runs.StopRequest.from_env()
        self.stopped_early = False
        self.resumed_from = self._resume_path(resume)  # checked before the model is built
        self.actor = MegatronActor(cfg, self.arch)  # initializes torch.distributed
        self.is_driver = is_driver()  # rank 0 (asked before the actor, every rank would say so)
        self.samples_generated = 0  # over the whole run (resumes included): train.sample_budget
        self.rl_seconds = self.rl_seconds_before = 0.0  # RL seconds, resumes included (rank 0's): train.time_budget_s
        self.start_step = self._restore(self.resumed_from)
        if is_driver():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.yaml")
        self.scorer = self.eval_scorer = None  # rank 0's: training samples, held-out eval (counted apart)
        on_driver(self._make_scorers)  # a bad reward.fn stops every rank here, before any server starts
        self.rollout = RolloutDriver(cfg, self.arch, self.tokenizer, self.run_dir, self.actor)
        self.phases = make_phases(cfg, self.rollout.engine, self.actor)  # colocated: who holds the GPU's memory
        # when samples are generated, on which weights (rollout.schedule): asked for each batch, told each version
        self.schedule = make_schedule(cfg, self.rollout.engine, self.prompts, self.sampler, self.scorer, self.tokenizer)
        self.updates = make_updates(cfg, self.schedule, self.actor)  # the batch whole, then trained; or streamed
        # the held-out eval samples as training does (a rollout function's own numbers counted apart)
        self.eval_rollouts = make_rollouts(cfg, self.rollout.engine, self.tokenizer) if is_driver() else None
        if self._resume_extra:
            self.schedule.load_state_dict(self._resume_extra)
        resume_log = self.start_step if self.resumed_from else False  # a fresh run keeps an old log as .prev
        self.logger = (
            MetricsLogger(self.run_dir, wandb_project=cfg.train.wandb_project, config=cfg, resume=resume_log)
            if is_driver()
            else None
        )

    # ------------------------------------------------------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
        self.start_eval = {}  # eval.at_start: the starting policy, before any warm start (step 0, as base/eval/...)
        if self.start_step == 0 and cfg.eval.at_start:
            self.rollout.sync_weights(self.actor, version=0)
            self.start_eval = self.evaluate(0)
        if self.start_step == 0 and cfg.train.supervised_warmup_steps:
            self.warm_start()  # logs step 0: where RL starts from, with the base model's eval as base/eval/...
        elif self.start_eval:
            self.log(0, self.start_eval)
        self.rollout.sync_weights(self.actor, version=self.start_step)
        self.schedule.weights_updated(self.start_step)
        last = {}
        steps = range(self.start_step + 1, cfg.train.steps + 1)
        started = time.monotonic()
        for step in track(steps, description="DAPO steps", disable=not is_driver() or not steps):
            times: dict[str, float] = {}
            with Timer("step", times):
                with Timer("rollout", times):  # rank 0 generates; each DP rank is sent its share of the batch
                    seqs, (metrics, sampling_stats) = self.updates.collect(step)  # streamed: updates as groups come
                self.samples_generated += sampling_stats["samples_generated"]
                self.rl_seconds = self.rl_seconds_before + float(broadcast(time.monotonic() - started))
                final = step == cfg.train.steps or self._budget_spent()
                # the next update's learning rate decays over what the run has spent of its budgets (lr_schedule.py)
                self.actor.scheduler.set_spent(self.samples_generated, self.rl_seconds)
                self.phases.to_train()  # colocated: engines release their memory, the trainer's state comes back
                with Timer("train", times):  # π_old logprobs (where a pass is needed) + the mini-batch updates
                    metrics.update(self.updates.train(seqs))
                if is_driver():  # the whole batch's groups: rank 0's; every rank checks rank 0's numbers
                    olds, unmeasured_ok = [s.old_logprobs for s in seqs], cfg.algo.old_logprobs == "rollout"
                    metrics.update(logprob_gap_stats(self.schedule.groups, olds, unmeasured_ok))
                    metrics["train/entropy"] = policy_entropy(seqs)
                metrics = broadcast(metrics)
                check_logprob_gap(metrics["train/logp_gap_mean"], cfg.rollout.logp_gap_alarm, step)
                self.phases.to_rollout()  # the trainer's grads + optimizer to the host, the engines resume
                if step % cfg.rollout.sync_every == 0 or final:  # else the engines keep generating on older weights
                    with Timer("sync", times):  # one_step_off/async: the batch in progress finishes first; stream:
                        self.schedule.before_sync()  # what is in flight is aborted and resumes on the new weights
                        metrics.update(self.rollout.sync_weights(self.actor, version=step))
                    self.schedule.weights_updated(step)
                if cfg.eval.interval and step % cfg.eval.interval == 0 or final:
                    with Timer("eval", times):
                        metrics.update(self.evaluate(step))
                saved = cfg.train.save_interval and step % cfg.train.save_interval == 0 or final
                if saved:
                    with Timer("save", times):
                        self.save(step)
            metrics.update(
                {
                    k if k.startswith(("reward/", "rollout/")) else f"train/{k}": float(v)
                    for k, v in sampling_stats.items()
                    if not k.startswith("total_")
                }
            )
            metrics["train/samples_generated_total"] = self.samples_generated
            metrics.update(times)
            metrics.update(getattr(self.phases, "timings", {}))
            if is_driver():  # only the driver logs: the other ranks skip walking their process tree
                metrics.update(memory_metrics())
            last = self.log(step, metrics)
            if step < cfg.train.steps and (final or self._stop_after(step, saved)):
                break  # the last step ends the loop itself, so the progress bar says 100%
        if cfg.train.steps == 0 and self.start_step == 0:  # a run of no RL steps keeps what it has (the warm start)
            self.save(0)
        # every run that reaches its end exports, a resume at (or past) the last step included (a requeued job whose
        # first attempt ended before or during its export); a fresh run of no RL steps keeps only its checkpoint
        ended = not self.stopped_early and (self.start_step < cfg.train.steps or self.resumed_from is not None)
        if cfg.train.export_hf and ended:
            self.export_hf(self.run_dir / "hf")
        if self.logger:
            self.logger.close()
        self.schedule.close()  # one_step_off/async: the producer thread ends (idle since the last sync)
        self.rollout.close()
        for scorer in (self.scorer, self.eval_scorer):
            if scorer is not None:
                scorer.close()
        return last

    def _budget_spent(self) -> bool:
        """``train.sample_budget`` samples generated or ``train.time_budget_s`` seconds of RL spent, resumes included
        (from the numbers all ranks share: the samples and rank 0's clock)."""
        t = self.cfg.train
        return bool(t.sample_budget and self.samples_generated >= t.sample_budget) or bool(
            t.time_budget_s and self.rl_seconds >= t.time_budget_s
        )

    def _make_scorers(self) -> None:
        """Rank 0: the reward scorers, and the user's rollout function imported once (a bad one stops every rank)."""
        self.scorer = RewardScorer.from_config(self.cfg.reward)
        self.eval_scorer = RewardScorer.from_config(self.cfg.reward)
        if self.cfg.rollout.generate is not None:
            load_callable(self.cfg.rollout.generate, "rollout.generate")

    # ------------------------------------------------------------------------------------------------------------------
    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out eval on rank 0; the metrics on every rank."""
        max_new = self.cfg.rollout.sampling.max_new_tokens
        return on_driver(
            lambda: run_eval(
                self.eval_rollouts,
                self.eval_scorer,
                self.eval_data,
                self.cfg.eval,
                max_new,
                self.cfg.train.seed + step,
            )
        )

    def warm_start(self) -> None:
        """Supervised warm start on the synthetic task (demo): NLL on " Answer: N<eos>" until held-out accuracy is
        reached, the step budget is spent, or ``train.time_budget_s`` when RL gets no steps (a supervised baseline)."""
        from megatron_dapo.data.synthetic import supervised_target

        t = self.cfg.train
        score, started = 0.0, time.monotonic()
        for k in range(1, t.supervised_warmup_steps + 1):
            out_of_time = bool(
                broadcast(t.steps == 0 and t.time_budget_s and time.monotonic() - started >= t.time_budget_s)
            )
            items = self.prompts.take(t.supervised_batch)
            seqs = []
            for it in items:
                target, mask = supervised_target(self.tokenizer, it.ground_truth, it.extra)
                seq = Sequence(torch.tensor(it.prompt_ids + target), prompt_len=len(it.prompt_ids))
                seq.loss_mask = torch.tensor(mask, dtype=torch.float32) if 0 in mask else None
                seqs.append(seq)
            self.phases.to_train()
            m = self.actor.supervised_step(seqs, lr=t.supervised_lr)
            # accuracy jumps fast once it starts: check every 10 steps from half the target on, every 20 before
            if (
                k % (10 if score >= t.supervised_stop_acc / 2 else 20) == 0
                or k == t.supervised_warmup_steps
                or out_of_time
            ):
                self.phases.to_rollout()
                self.rollout.sync_weights(self.actor, version=0)
                acc = self.evaluate(0)
                score = min((v for key, v in acc.items() if "/avg@" in key), default=0.0)
                self.log(0, {**m, "sft/step": k, **{f"sft/{key}": v for key, v in acc.items()}}, persist=False)
                if score >= t.supervised_stop_acc or out_of_time:
                    break
        base = {f"base/{key}": v for key, v in getattr(self, "start_eval", {}).items()}
        self.log(0, {"sft/steps": k, **acc, **base})  # step 0 of metrics.jsonl: where RL starts from
        self.actor.reset_optimizer_state()

    # ------------------------------------------------------------------------------------------------------------------
    def save(self, step: int) -> None:
        # the schedule's state: prompt cursor, sampler counters, samples carried in flight (rank 0's is saved)
        extra = {
            **self.schedule.state_dict(),
            "step": step,
            "samples_generated": self.samples_generated,
            "rl_seconds": self.rl_seconds,
        }
        self.actor.save(self.ckpt_dir / runs.checkpoint_dir_name(step), extra=extra)
        if is_driver() and self.cfg.train.keep_checkpoints:  # keep the newest train.keep_checkpoints, by step number
            for _, old in runs.checkpoints(self.ckpt_dir)[: -self.cfg.train.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()

    def _stop_after(self, step: int, saved: bool) -> bool:
        """A stop was asked for (the time-limit signal): save now unless this step just did, and stop the loop."""
        reason = broadcast(self.stop.requested() if is_driver() else None)
        if not reason:
            return False
        if not saved:
            self.save(step)
        self.stopped_early = True
        if is_driver():
            print(
                f"stopped after step {step} of {self.cfg.train.steps} ({reason}); saved "
                f"{self.ckpt_dir / runs.checkpoint_dir_name(step)}: run again with --resume auto to continue",
                flush=True,
            )
        return True

    def _resume_path(self, resume: str | None) -> Path | None:
        """``--resume auto``: the newest complete checkpoint of this run, if there is one; ``none``: a fresh start,
        refused over a run that has checkpoints (its metrics and checkpoints would mix with the new run's); a
        directory: that checkpoint, which must hold this architecture."""
        latest = runs.latest_checkpoint(self.ckpt_dir)
        if resume in (None, "none"):
            if latest:
                raise ConfigError(
                    f"--resume none: {self.ckpt_dir} already holds checkpoints of run {self.cfg.train.name!r} (up to "
                    f"step {latest[0]}): --resume auto continues it; for a new run set another train.name"
                )
            return None
        path = (latest[1] if latest else None) if resume == "auto" else Path(resume)
        if path is not None:
            ckpt.check_arch(path, self.arch)
        return path

    def _restore(self, path: Path | None) -> int:
        """Load the resume checkpoint (or ``model.load`` / ``model.hf_init`` for a fresh start); return the step to
        continue after."""
        from megatron_dapo.actor.checkpoint import base_source
        from megatron_dapo.bridge.load import load_checkpoint, load_hf_into_model

        self._resume_extra = None
        if path is None:
            if self.cfg.model.load:
                load_checkpoint(self.actor, self.cfg.model.load, load_optimizer=False)
            elif self.cfg.model.hf_init:
                load_hf_into_model(self.actor.model, self.arch, self.cfg.model.hf_init, te=self.actor.te)
            return 0
        extra = load_checkpoint(self.actor, path, base=base_source(self.cfg))  # a LoRA run's base first
        self.samples_generated = int(extra.get("samples_generated", 0))
        self.rl_seconds = self.rl_seconds_before = float(extra.get("rl_seconds", 0.0))
        self._resume_extra = extra  # prompt cursor, sampler, carried samples: the schedule's, once it is built
        if is_driver():
            print(f"resuming from {path} (step {extra['step']})", flush=True)
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
        """The trained policy as an HF checkpoint (safetensors + config.json + tokenizer) that transformers loads; with
        LoRA the adapters merged into it, and beside it (``<out>_adapter``) the adapters alone in PEFT's format."""
        from megatron_dapo.bridge.export import save_hf_checkpoint

        save_hf_checkpoint(self.actor.model, self.arch, out, self.tokenizer, self.cfg.rollout.bucket_mb << 20)
        if self.actor.lora_layers:
            from megatron_dapo.bridge.peft import save_peft_adapter

            base = self.cfg.model.hf_init
            save_peft_adapter(self.actor.model, self.arch, self.cfg.model.lora, f"{out}_adapter", base)
