"""How a step's samples are generated: the engine's own batched single-turn generation (the default), or the user's
rollout function, ``rollout.generate: "package.module:function"``, called once per sample.

    def generate(client: RolloutClient, item: RolloutInput, sampling: SamplingParams, **generate_args) -> RolloutOutput

``client.generate(input_ids, max_new_tokens)`` is token ids in, a ``Sample`` (token ids, logprobs, finish reason)
out; ``client.encode`` / ``client.decode`` are the run's tokenizer. The function returns the response tokens, their
logprobs and a per-token loss mask (0 = inserted by the rollout, such as a tool's output: never trained). Calls run on
``rollout.generate_concurrency`` threads; the requests they make at the same moment go to the engine together, as one
batch. Dynamic sampling stops a generation batch once it has its groups: the engine aborts what is in flight, later
``client.generate`` calls raise ``RolloutAborted``, and the unfinished samples are dropped; with ``rollout.partial``
they are kept and resumed mid-turn (``ResumingClient``).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import hashlib
import inspect
import queue
import threading
from collections.abc import Iterator
from typing import Any

from megatron_dapo.algo.offpolicy import settle_finish
from megatron_dapo.config.plugins import load_callable
from megatron_dapo.rollouts.tools import ToolBudget
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
        sample = self.request(input_ids, max_new_tokens, seed)
        if sample.finish_reason == "abort" and self._cancelled.is_set():
            raise RolloutAborted()
        return sample

    def request(self, input_ids: list[int], max_new_tokens: int, seed: int | None = None) -> Sample:
        """``generate``, but an aborted call returns what it had generated (finish_reason 'abort')."""
        if self._cancelled.is_set():
            raise RolloutAborted()
        if max_new_tokens < 1:
            raise ValueError(f"client.generate: max_new_tokens = {max_new_tokens}: must be >= 1")
        future: cf.Future = cf.Future()
        self._queue.put((GenRequest(list(input_ids), int(max_new_tokens), seed), future))
        return future.result()

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


def _digest(ids: list[int]) -> str:
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:20]


class ResumingClient:
    """The client a rollout function gets under partial rollout (``rollout.partial``): an aborted sample resumes
    mid-turn. Its function runs again from the start; the engine calls it made before come back as they were (recorded
    in ``calls``: tokens, logprobs, each token's weight version), the call the abort cut short is continued with the
    budget it had left (its tokens so far are kept, never generated again), later calls are new. So a rollout function
    must be a function of its input and of what the client returns (tools included); one that asks something else than
    it did before (a tool whose output changed) gets new generations from there on, counted as
    ``rollout/replay_diverged``. ``calls`` is plain data: it is checkpointed with the carried sample."""

    def __init__(self, client: RolloutClient, calls: list[dict], version: int, stops: frozenset[int]):
        self.client, self.calls, self.version, self.stops = client, calls, version, stops
        self.tokenizer, self.sampling, self.eos_token_ids = client.tokenizer, client.sampling, client.eos_token_ids
        self.k = 0  # the function's next call
        self.diverged = False

    def encode(self, text: str) -> list[int]:
        return self.client.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.client.decode(ids)

    def generate(self, input_ids: list[int], max_new_tokens: int, seed: int | None = None) -> Sample:
        key = _digest(input_ids)
        if self.k < len(self.calls) and self.calls[self.k]["input"] != key:
            del self.calls[self.k :]  # not what it asked before: new from here on
            self.diverged = True
        if self.k == len(self.calls):
            self.calls.append({"input": key, "response_ids": [], "logprobs": [], "versions": [], "finish": "abort"})
        call = self.calls[self.k]
        if call["finish"] == "abort":
            left = max_new_tokens - len(call["response_ids"])
            if left >= 1:
                s = self.client.request(list(input_ids) + call["response_ids"], left, seed)
                call["response_ids"] += list(s.response_ids)
                call["logprobs"] += list(s.logprobs)
                call["versions"] += [self.version] * len(s.response_ids)
                call["finish"] = settle_finish(s.finish_reason, call["response_ids"], max_new_tokens, self.stops)
            else:
                call["finish"] = "length"
            if call["finish"] == "abort":
                raise RolloutAborted()  # what it has stays in ``calls``: continued when the sample resumes
        self.k += 1
        return Sample(
            list(input_ids),
            list(call["response_ids"]),
            list(call["logprobs"]),
            call["finish"],
            weight_version=min(call["versions"], default=self.version),
        )

    def token_versions(self, n: int, loss_mask: list[int] | None) -> list[int]:
        """Per response token, the weights it was sampled on: the calls' tokens in order for the generated ones
        (mask 1) when they add up, inserted tokens the current version (never trained); else, conservatively, the
        oldest version of any call for every token."""
        made = [v for c in self.calls[: self.k] for v in c["versions"]]
        mask = loss_mask if loss_mask is not None else [1] * n
        if sum(mask) == len(made):
            versions = iter(made)
            return [next(versions) if m else self.version for m in mask]
        return [min(made, default=self.version)] * n


class FunctionRollouts:
    """``rollout.generate``: the user's function per sample, on threads; groups of ``n`` Samples as they complete."""

    def __init__(self, spec: str, generate_args: dict, concurrency: int, engine, tokenizer: Any, tools: Any = None):
        self.spec, self.fn = spec, load_callable(spec, "rollout.generate")
        self.args, self.concurrency = dict(generate_args), concurrency
        # a function taking ``tool_budget`` gets a fresh one per sample, made from rollout.tools
        takes_budget = tools is not None and "tool_budget" in inspect.signature(self.fn).parameters
        self._budget = dataclasses.asdict(tools) if takes_budget else None
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

    def resume(self, jobs: list, sampling: SamplingParams, version: int, stops: frozenset[int]) -> Iterator[tuple]:
        """Partial rollout: run ``jobs`` (item, group index, sample index, that sample's recorded calls: updated in
        place) and yield ``(group index, sample index, Sample, per-token weight versions)`` as each finishes; an
        aborted one yields nothing and keeps its calls for next time."""
        self._cancelled.clear()
        client = RolloutClient(self.engine, self.tokenizer, sampling, self._cancelled)
        pool = cf.ThreadPoolExecutor(self.concurrency, thread_name_prefix="rollout-fn")

        def run(item, gi: int, j: int, calls: list) -> tuple | None:
            done = self.run_one(client, item, sampling, gi, j, calls, version, stops)
            return None if done is None else (gi, j, *done)

        try:
            futures = [pool.submit(run, *job) for job in jobs]
            for future in cf.as_completed(futures):
                if (result := future.result()) is not None:
                    yield result
        finally:
            self._cancelled.set()
            pool.shutdown(wait=True, cancel_futures=True)
            client.close()

    def client(self, sampling: SamplingParams) -> RolloutClient:
        """A client for ``run_one`` calls (the streaming schedule keeps one; ``abort`` stops its callers)."""
        self._cancelled.clear()
        return RolloutClient(self.engine, self.tokenizer, sampling, self._cancelled)

    def run_one(self, client, item, sampling, gi: int, j: int, calls: list, version: int, stops: frozenset[int]):
        """One sample's function, resumed from its recorded ``calls`` (updated in place): ``(Sample, per-token
        versions)``, or None when it was aborted (it keeps its calls for next time)."""
        resuming = ResumingClient(client, calls, version, stops)
        sample = self._one(resuming, item, sampling, gi, j)
        if resuming.diverged:
            self._sums["replay_diverged"][0] += 1
        self._sums["replay_diverged"][1] += 1
        if sample is None:
            return None
        return sample, resuming.token_versions(len(sample.response_ids), sample.loss_mask)

    def resume_lanes(self) -> None:
        """The streaming schedule's lanes may call again after an abort."""
        self._cancelled.clear()

    def _one(self, client, item, sampling: SamplingParams, p: int, j: int) -> Sample | None:
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
            extra = {} if self._budget is None else {"tool_budget": ToolBudget(**self._budget)}
            out = self.fn(client, inp, sampling, **self.args, **extra)
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
    return FunctionRollouts(r.generate, r.generate_args, r.generate_concurrency, engine, tokenizer, r.tools)
