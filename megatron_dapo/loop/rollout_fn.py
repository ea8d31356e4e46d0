"""How a step's samples are generated: the engine's own batched single-turn generation (the default), or the user's
rollout function, ``rollout.generate: "package.module:function"``, called once per sample.

    def generate(client: RolloutClient, item: RolloutInput, sampling: SamplingParams, **generate_args) -> RolloutOutput

``client.generate(input_ids, max_new_tokens)`` is token ids in, a ``Sample`` (token ids, logprobs, finish reason)
out; ``client.encode`` / ``client.decode`` are the run's tokenizer. The function returns the response tokens, their
logprobs and a per-token loss mask (0 = inserted by the rollout, such as a tool's output: never trained). Calls run on
``rollout.generate_concurrency`` threads; the requests they make at the same moment go to the engine together, as one
batch. Dynamic sampling stops a generation batch once it has its groups: the engine aborts what is in flight, later
``client.generate`` calls raise ``RolloutAborted``, and the unfinished samples are dropped.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import queue
import threading
from collections.abc import Iterator
from typing import Any

from megatron_dapo.config.plugins import load_callable
from megatron_dapo.types import GenRequest, RolloutInput, RolloutOutput, Sample, SamplingParams, sample_seed


class RolloutAborted(Exception):
    """The generation batch has its groups: the rollout function's sample is no longer wanted."""


class EngineRollouts:
    """The default: the engine generates ``n`` samples per prompt itself (one prefill per group)."""

    def __init__(self, engine):
        self.engine = engine

    def stream(self, items: list, sampling: SamplingParams, n: int) -> Iterator[list[Sample]]:
        return self.engine.generate_stream([it.prompt_ids for it in items], sampling, n=n)

    def abort(self) -> None:
        self.engine.abort()

    def metrics(self, reset: bool = False) -> dict[str, float]:
        return {}


class RolloutClient:
    """What a rollout function calls: token ids in, token ids and logprobs out; concurrent calls share one batch."""

    def __init__(self, engine, tokenizer: Any, sampling: SamplingParams, cancelled: threading.Event):
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        self.eos_token_ids = tuple(engine.tokenizer.eos_token_ids) if engine.tokenizer is not None else ()
        self._cancelled = cancelled
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._dispatch, name="rollout-client", daemon=True)
        self._thread.start()

    def generate(self, input_ids: list[int], max_new_tokens: int, seed: int | None = None) -> Sample:
        """One continuation of ``input_ids`` (the run's sampling settings, this budget and seed)."""
        if self._cancelled.is_set():
            raise RolloutAborted()
        if max_new_tokens < 1:
            raise ValueError(f"client.generate: max_new_tokens = {max_new_tokens}: must be >= 1")
        future: cf.Future = cf.Future()
        self._queue.put((GenRequest(list(input_ids), int(max_new_tokens), seed), future))
        sample = future.result()
        if sample.finish_reason == "abort" and self._cancelled.is_set():
            raise RolloutAborted()
        return sample

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _dispatch(self) -> None:
        """One engine call at a time, with every request waiting at that moment (a batch)."""
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while True:
                try:
                    item = self._queue.get(timeout=0.002)  # the other threads' requests of this moment
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                batch.append(item)
            if self._cancelled.is_set():  # the batch has its groups: these are not wanted (RolloutAborted)
                for request, future in batch:
                    future.set_result(Sample(request.input_ids, [], [], "abort"))
                continue
            try:
                for sample in self.engine.generate_requests([r for r, _ in batch], self.sampling):
                    batch[sample.prompt_index][1].set_result(sample)
            except Exception as e:  # noqa: BLE001 - every waiting rollout function gets the engine's error
                for _, future in batch:
                    if not future.done():
                        future.set_exception(e)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)


class FunctionRollouts:
    """``rollout.generate``: the user's function per sample, on threads; groups of ``n`` Samples as they complete."""

    def __init__(self, spec: str, generate_args: dict, concurrency: int, engine, tokenizer: Any):
        self.spec, self.fn = spec, load_callable(spec, "rollout.generate")
        self.args, self.concurrency = dict(generate_args), concurrency
        self.engine, self.tokenizer = engine, tokenizer
        self._cancelled = threading.Event()
        self._sums: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])

    def stream(self, items: list, sampling: SamplingParams, n: int) -> Iterator[list[Sample]]:
        self._cancelled.clear()
        client = RolloutClient(self.engine, self.tokenizer, sampling, self._cancelled)
        pool = cf.ThreadPoolExecutor(self.concurrency, thread_name_prefix="rollout-fn")
        try:
            futures = {
                pool.submit(self._one, client, item, sampling, p, j): (p, j)
                for p, item in enumerate(items)
                for j in range(n)
            }
            done: dict[int, list] = collections.defaultdict(list)
            for future in cf.as_completed(futures):
                sample = future.result()
                if sample is None:  # aborted
                    continue
                p = sample.prompt_index
                done[p].append(sample)
                if len(done[p]) == n:
                    yield sorted(done.pop(p), key=lambda s: s.sample_index)
        finally:
            self._cancelled.set()
            pool.shutdown(wait=True, cancel_futures=True)
            client.close()

    def _one(self, client: RolloutClient, item, sampling: SamplingParams, p: int, j: int) -> Sample | None:
        inp = RolloutInput(
            prompt_ids=list(item.prompt_ids),
            prompt_text=item.prompt_text,
            messages=list(item.messages),
            ground_truth=item.ground_truth,
            metadata={**item.extra, "data_source": item.data_source, "index": item.index, "source": item.source},
            sample_index=j,
            seed=sample_seed(sampling.seed, p, j),
        )
        try:
            out = self.fn(client, inp, sampling, **self.args)
        except RolloutAborted:
            return None
        except Exception as e:
            if self._cancelled.is_set():
                return None
            raise RuntimeError(
                f"rollout.generate {self.spec!r} raised on {item.source or f'prompt {item.index}'} (sample {j}): "
                f"{type(e).__name__}: {e}"
            ) from e
        if self._cancelled.is_set():
            return None
        if not isinstance(out, RolloutOutput):
            raise TypeError(f"rollout.generate {self.spec!r} returned {type(out).__name__}, not a RolloutOutput")
        for name, value in out.metrics.items():
            self._sums[name][0] += float(value)
            self._sums[name][1] += 1
        decode = self.engine.tokenizer.text if self.engine.tokenizer is not None else (lambda ids: "")
        return Sample(
            prompt_ids=list(item.prompt_ids),
            response_ids=list(out.response_ids),
            logprobs=list(out.logprobs),
            finish_reason=out.finish_reason,
            text=out.text if out.text is not None else decode(list(out.response_ids)),
            prompt_index=p,
            sample_index=j,
            weight_version=self.engine.weight_version,
            loss_mask=list(out.loss_mask) if out.loss_mask is not None else None,
        )

    def abort(self) -> None:
        self._cancelled.set()
        self.engine.abort()

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """The rollout function's numbers, averaged over its samples since the last reset: ``rollout/<name>``."""
        out = {f"rollout/{k}": total / count for k, (total, count) in self._sums.items() if count}
        if reset:
            self._sums.clear()
        return out


def make_rollouts(cfg: Any, engine, tokenizer: Any) -> EngineRollouts | FunctionRollouts:
    r = cfg.rollout
    if r.generate is None:
        return EngineRollouts(engine)
    return FunctionRollouts(r.generate, r.generate_args, r.generate_concurrency, engine, tokenizer)
