"""When samples are generated and on which weights: the one object the training loop asks for its batch.

    schedule = make_schedule(cfg, engine, prompts, sampler, scorer)   # every rank; only rank 0 generates
    seqs, (metrics, stats) = schedule.next_batch(step)   # rank 0: B groups judged complete, as training sequences
    ...train...
    schedule.before_sync()                                # every rank: engines idle, ranks met (control plane)
    schedule.weights_updated(version)                     # every rank, once the engines hold ``version``
    extra = schedule.state_dict()                         # prompt cursor, sampler counters, carried samples

``SyncSchedule`` (the default): generate, score and filter groups until B are kept (dynamic sampling, cut in prompt
order), abort the surplus and drop it. ``PartialSchedule`` (``rollout.partial``): the same, but what is in flight at
the cut is aborted and KEPT: every sample's tokens, rollout logprobs and the weight version of each token. The next
step resumes them first (input = prompt + the response so far, budget = max_new_tokens − already generated, never a
fresh one); a group is judged only once all G samples have finished, and carried groups come before new prompts, so
selection is not biased toward short responses. A carried group whose oldest token is more than
``rollout.partial_max_age`` versions behind is dropped, and counted. Tokens from older weights than the trainer's
are tagged (``Group.token_lag``) for per-token TIS (``algo.tis: auto``).

``rollout.schedule: one_step_off | async`` (a producer thread generating ahead of the trainer): ``async_schedule.py``.
The trainer keeps no branch on the schedule: it calls these methods whatever the mode.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from megatron_dapo.algo.batch import Group, group_from_samples, to_sequences
from megatron_dapo.algo.offpolicy import remaining_budget, version_lag_stats
from megatron_dapo.algo.sampling import PromptOrderCollector
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.data.dataset import PromptItem
from megatron_dapo.loop.async_schedule import AsyncSchedule
from megatron_dapo.loop.carried import Carried, Slot, carried_group, extend_slot, finish_slot  # noqa: F401 (re-exported)
from megatron_dapo.loop.control import on_driver
from megatron_dapo.loop.rollout_fn import EngineRollouts, FunctionRollouts, make_rollouts
from megatron_dapo.types import GenRequest, SamplingParams, sample_seed


def make_schedule(cfg, engine, prompts, sampler, scorer, tokenizer=None):
    """``tokenizer``: the run's (a rollout function encodes a tool's output with it)."""
    rollouts = make_rollouts(cfg, engine, tokenizer) if engine is not None else None
    if cfg.rollout.schedule == "stream":
        from megatron_dapo.loop.stream_schedule import StreamSchedule

        return StreamSchedule(cfg, engine, prompts, sampler, scorer, rollouts)
    inner = (PartialSchedule if cfg.rollout.partial else SyncSchedule)(cfg, engine, prompts, sampler, scorer, rollouts)
    return inner if cfg.rollout.schedule == "sync" else AsyncSchedule(cfg, inner)  # a producer thread drives inner


class SyncSchedule:
    """Generate until B groups are kept, abort and drop the surplus (the step waits for its slowest kept sample)."""

    def __init__(self, cfg, engine, prompts, sampler, scorer, rollouts=None):
        self.cfg, self.engine, self.prompts, self.sampler, self.scorer = cfg, engine, prompts, sampler, scorer
        # how samples are generated: the engine's batched single turn, or the user's rollout.generate function
        self.rollouts = rollouts if rollouts is not None else EngineRollouts(engine)
        self.groups: list[Group] = []  # the last batch's groups (rank 0)
        self.version = 0  # the weights the engines hold

    def next_batch(self, step: int) -> tuple[list, tuple[dict, dict]]:
        """Rank 0: this step's groups (kept in ``self.groups``) as training sequences, (reward metrics, sampling
        stats)."""
        self.groups, stats = self.collect_groups(step)
        seqs, metrics = to_sequences(self.groups, self.cfg)
        metrics.update(self.batch_metrics())
        return seqs, (metrics, stats)

    def batch_metrics(self) -> dict[str, float]:
        return {}

    def before_sync(self) -> None:
        """Every rank: the ranks meet on the control plane (gloo, ``rollout.control_timeout_s``) before the sync's
        collectives on the default group (NCCL on GPU, ``parallel.collective_timeout_s``), so none waits there for
        rank 0; an error of rank 0's reaches every rank. Nothing generates between steps here (one_step_off/async:
        rank 0 first waits for the batch in progress)."""
        on_driver(self._drain)

    def _drain(self) -> None:
        """Rank 0: the engines idle before the weight sync."""

    def weights_updated(self, version: int) -> None:
        self.version = int(version)

    def close(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"prompts": self.prompts.state_dict(), "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.sampler.load_state_dict(state["sampler"])
        if state.get("schedule"):
            raise ConfigError(
                "the checkpoint holds samples carried by partial rollout; resume it with rollout.partial=true"
            )
        if (state.get("stream") or {}).get("window"):
            raise ConfigError("the checkpoint holds samples in flight of a streaming run: resume it with "
                              "rollout.schedule=stream")  # fmt: skip
        if (state.get("async") or {}).get("ready"):
            raise ConfigError(
                f"the checkpoint holds batches generated but not yet trained: resume it with "
                f"rollout.schedule={state['async']['kind']}"
            )

    def sampling(self, step: int, batch_index: int) -> SamplingParams:
        seed = self.cfg.train.seed * 1_000_003 + step * 101 + batch_index
        return SamplingParams.from_config(self.cfg.rollout.sampling, seed=seed)

    def _new_step(self) -> None:
        self.engine.new_step()  # the restart budget is per step

    def _finish_stats(self, generated: list[bool]) -> dict:
        stats = self.sampler.stats()
        stats["kept_groups"] = stats.pop("kept")
        stats["acc_generated"] = sum(generated) / max(1, len(generated))  # before filtering (acc_mean: kept groups)
        stats["samples_generated"] = len(generated)
        stats["server_restarts"] = self.engine.step_restarts
        stats.update(self.scorer.metrics(reset=True))  # reward/...: counts and the reward function's own numbers
        stats.update(self.rollouts.metrics(reset=True))  # rollout/...: the rollout function's numbers
        return stats

    def collect_groups(self, step: int) -> tuple[list[Group], dict]:
        """Rank 0: generate, score and filter groups until B are kept (dynamic sampling), aborting the surplus."""
        cfg, sampler = self.cfg, self.sampler
        self._new_step()
        batch_index, generated = 0, []
        while not sampler.full:
            items = self.prompts.take(cfg.algo.gen_batch_prompts)
            collector = PromptOrderCollector(len(items), sampler.missing, cfg.algo.dynamic_sampling)
            stream = self.rollouts.stream(items, self.sampling(step, batch_index), cfg.algo.group_size)
            with contextlib.closing(stream):
                for samples in stream:
                    item = items[samples[0].prompt_index]
                    results = self.scorer.score_batch([s.text for s in samples], [item] * len(samples))
                    group = group_from_samples(item.prompt_ids, samples, results, item.data_source)
                    generated += group.correct
                    if collector.add(samples[0].prompt_index, group, torch.tensor(group.correct)):
                        self.rollouts.abort()  # the first informative groups in prompt order are in: drop the rest
                        break
            sampler.add(*collector.take())
            batch_index += 1
        return sampler.take(), self._finish_stats(generated)


# ----------------------------------------------------------------------------------------------------------------------
# Partial rollout


class PartialSchedule(SyncSchedule):
    """Abort the surplus but keep it; resume it first next step with the budget it has left."""

    def __init__(self, cfg, engine, prompts, sampler, scorer, rollouts=None):
        super().__init__(cfg, engine, prompts, sampler, scorer, rollouts)
        self.carried: list[Carried] = []
        self.totals = {"dropped_stale_groups": 0, "dropped_stale_samples": 0, "resumed_samples": 0}
        self._step: dict[str, float] = {}

    # -- the step --------------------------------------------------------------------------------------------------
    def collect_groups(self, step: int) -> tuple[list[Group], dict]:
        cfg, sampler = self.cfg, self.sampler
        G, gen_batch = cfg.algo.group_size, cfg.algo.gen_batch_prompts
        self._new_step()
        self._step = {"resumed_samples": 0, **self._drop_stale()}
        work, self.carried = self.carried, []
        batch_index, generated, finished_samples = 0, [], 0
        while not sampler.full:
            # the carried groups first, topped up to gen_batch_prompts with new prompts; later rounds: new prompts
            fresh = self.prompts.take(max(0, gen_batch - len(work)))
            entries = work + [Carried(it, [Slot() for _ in range(G)]) for it in fresh]
            work = []
            judged, done, finished = self._round(entries, self.sampling(step, batch_index))
            generated += judged
            finished_samples += finished
            groups, correct = done.take()  # the groups before the prompt-order cut
            sampler.add(groups, correct if correct is not None else torch.zeros((0, G), dtype=torch.bool))
            self.carried += entries[len(groups) :]  # after the cut, finished or not: judged next step, first
            batch_index += 1
        batch = sampler.take()
        stats = self._finish_stats(generated)
        stats["samples_generated"] = finished_samples  # every sample counted once, in the step it finishes
        self._step.update(
            carried_groups=len(self.carried), carried_samples=sum(not s.finished for c in self.carried for s in c.slots)
        )
        self.totals["resumed_samples"] += self._step["resumed_samples"]
        return batch, stats

    def _round(self, entries: list[Carried], sampling: SamplingParams):
        """One generation round over ``entries`` (prompt order): complete groups are judged first, then the
        unfinished slots run until the prompt-order cut; the rest is aborted and drained back into its slots."""
        cfg, engine = self.cfg, self.engine
        max_new = cfg.rollout.sampling.max_new_tokens
        collector = PromptOrderCollector(len(entries), self.sampler.missing, cfg.algo.dynamic_sampling)
        judged: list[bool] = []

        def judge(gi: int) -> bool:
            group = self._group(entries[gi])
            judged.extend(group.correct)
            return collector.add(gi, group, torch.tensor(group.correct))

        cut = any(judge(gi) for gi, c in enumerate(entries) if c.complete)
        if isinstance(self.rollouts, FunctionRollouts):
            return judged, collector, self._run_functions(entries, sampling, judge, cut)
        requests, owners = [], []
        for gi, c in enumerate(entries):
            for j, slot in enumerate(c.slots):
                if slot.finished:
                    continue
                budget = remaining_budget(max_new, len(slot.response_ids))
                requests.append(
                    GenRequest(
                        list(c.item.prompt_ids) + slot.response_ids,
                        budget,
                        sample_seed(sampling.seed, gi, j),
                        route=gi,
                        offset=len(slot.response_ids),
                    )
                )
                owners.append((gi, j))
        finished, stops = 0, self._stop_ids(sampling)
        if requests and not cut:  # else the carried complete groups filled the batch: the rest waits a step
            self._step["resumed_samples"] += sum(
                len(r.input_ids) > len(entries[gi].item.prompt_ids) for r, (gi, _) in zip(requests, owners)
            )
            for s in engine.generate_requests(requests, sampling):
                gi, j = owners[s.prompt_index]
                slot = entries[gi].slots[j]
                self._extend(slot, s, max_new, stops)
                finished += slot.finished
                if not cut and entries[gi].complete and judge(gi):
                    cut = True
                    engine.abort()  # the first informative groups in prompt order are in: keep the rest for later
        return judged, collector, finished

    def _run_functions(self, entries: list[Carried], sampling: SamplingParams, judge, cut: bool) -> int:
        """``_round`` for a rollout function (``rollout.generate``): each unfinished slot's function runs, resumed
        mid-turn from its recorded calls; a finished sample fills its slot, an aborted one keeps its calls."""
        jobs = [
            (c.item, gi, j, slot.calls)
            for gi, c in enumerate(entries)
            for j, slot in enumerate(c.slots)
            if not slot.finished
        ]
        if not jobs or cut:
            return 0
        begun = {(gi, j) for _, gi, j, calls in jobs if any(c["response_ids"] for c in calls)}
        self._step["resumed_samples"] += len(begun)
        finished = 0
        for gi, j, sample, versions in self.rollouts.resume(jobs, sampling, self.version, self._stop_ids(sampling)):
            slot = entries[gi].slots[j]
            slot.resumed += (gi, j) in begun
            finish_slot(slot, sample, versions, self.cfg.rollout.sampling.max_new_tokens)
            finished += 1
            if not cut and entries[gi].complete and judge(gi):
                cut = True
                self.rollouts.abort()  # the first informative groups in prompt order are in: the rest resumes later
        return finished

    def _stop_ids(self, sampling: SamplingParams) -> frozenset[int]:
        """The tokens that end a sample: the tokenizer's EOS ids and the sampling's stop ids (what the engines send)."""
        eos = self.engine.tokenizer.eos_token_ids if self.engine.tokenizer is not None else ()
        return frozenset(eos) | frozenset(sampling.stop_token_ids)

    def _extend(self, slot: Slot, s, max_new: int, stops: frozenset[int] = frozenset()) -> None:
        extend_slot(slot, s, self.version, max_new, stops, self.engine.tokenizer)

    def _group(self, c: Carried) -> Group:
        return carried_group(c, self.scorer, self.version)

    def _drop_stale(self) -> dict[str, int]:
        """Carried groups whose oldest token is more than ``rollout.partial_max_age`` versions old: dropped."""
        limit, kept, groups, samples = self.cfg.rollout.partial_max_age, [], 0, 0
        for c in self.carried:
            oldest = c.oldest_version()
            if oldest is not None and self.version - oldest > limit:
                groups, samples = groups + 1, samples + len(c.slots)
            else:
                kept.append(c)
        self.carried = kept
        self.totals["dropped_stale_groups"] += groups
        self.totals["dropped_stale_samples"] += samples
        return {"dropped_stale_groups": groups, "dropped_stale_samples": samples}

    def batch_metrics(self) -> dict[str, float]:
        """rollout/: version lag of the batch's tokens, the fraction carried from earlier steps, carried/dropped."""
        lags = [row for g in self.groups for row in g.token_lag]
        out = {f"rollout/{k}": float(v) for k, v in version_lag_stats(lags).items()}
        out.update({f"rollout/{k}": float(v) for k, v in self._step.items()})
        out.update({f"rollout/{k}_total": float(v) for k, v in self.totals.items()})
        return out

    # -- resume ----------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        carried = [
            {"item": dataclasses.asdict(c.item), "slots": [dataclasses.asdict(s) for s in c.slots]}
            for c in self.carried
        ]
        return {
            **super().state_dict(),
            "schedule": {"kind": "partial", "version": self.version, "carried": carried, "totals": dict(self.totals)},
        }

    def load_state_dict(self, state: dict) -> None:
        own = state.get("schedule") or {"carried": [], "totals": self.totals}
        super().load_state_dict({k: v for k, v in state.items() if k != "schedule"})
        self.carried = []
        for c in own["carried"]:
            self.carried.append(Carried(PromptItem(**c["item"]), [Slot(**s) for s in c["slots"]]))
        self.totals.update(own.get("totals", {}))
