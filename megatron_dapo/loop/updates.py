"""How a step's batch reaches the actor's updates: collected whole, then trained (every schedule), or trained a
mini-batch at a time as its groups are kept (``train.stream_updates``: the stream schedule).

    updates = make_updates(cfg, schedule, actor)
    seqs, (metrics, stats) = updates.collect(step)      # every rank; streamed: the updates run meanwhile
    train_metrics = updates.train(seqs)                 # the step's updates (streamed: their end, the LR schedule)
"""

from __future__ import annotations

from functools import partial

from megatron_dapo.loop.control import is_driver, on_driver, scatter_batch


class CollectThenTrain:
    """The whole batch first (``schedule.next_batch``, scattered over DP), then ``num_updates`` mini-batch updates."""

    def __init__(self, cfg, schedule, actor):
        self.cfg, self.schedule, self.actor = cfg, schedule, actor

    def collect(self, step: int):
        return scatter_batch(partial(self.schedule.next_batch, step), self.actor)

    def train(self, seqs: list) -> dict[str, float]:
        return self.actor.train_step(seqs)


class StreamedUpdates(CollectThenTrain):
    """``train.stream_updates``: mini-batch k's update starts once the batch's k-th ``mini_batch_prompts`` groups are
    kept (``StreamSchedule.mini_batches``), while the lanes keep generating; each mini-batch is scattered over DP on
    its own. The batch and its metrics are those ``next_batch`` gives; π_old is the rollout's."""

    def collect(self, step: int):
        size = self.cfg.train.mini_batch_prompts
        minis = self.schedule.mini_batches(step, size) if is_driver() else None
        trained: list = []

        def next_mini(_k: int) -> list:
            seqs, _ = scatter_batch(lambda: (next(minis), None), self.actor, one_update=True)
            trained.extend(seqs)  # the objects trained: rank 0's metrics read the π_old the first update recorded
            return seqs

        self._tally = self.actor.train_streamed(next_mini, self.cfg.num_updates)

        def batch_extra():
            for _ in minis:  # runs the generator to its end: the batch is cut, its metrics made
                raise RuntimeError(f"step {step}: more than train.batch_prompts / {size} mini-batches were kept")
            return self.schedule.last_batch[1]

        return trained, on_driver(batch_extra)

    def train(self, seqs: list) -> dict[str, float]:
        return self.actor.finish_step(self._tally)


def make_updates(cfg, schedule, actor) -> CollectThenTrain:
    return (StreamedUpdates if cfg.train.stream_updates else CollectThenTrain)(cfg, schedule, actor)
