"""The rollout-engine contract: what every engine (``engines/hf.py`` on a CPU, ``engines/sglang`` on GPUs or CPU
cores) provides, and the rollout/actor logprob gap every step checks.

    engine.update_weights(buckets, version)                 # buckets: iterable of [(hf_name, full tensor), ...]
    for group in engine.generate_stream(prompts, sampling, n=G):
        keep(group)                                         # n Samples of one prompt, as soon as they are all done
        if enough: engine.abort(); break                    # drop the surplus still in flight

The logprob convention is in ``megatron_dapo/types.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

from megatron_dapo.types import Bucket, GenRequest, LogprobGapError, Sample, SamplingParams, TokenizerInfo


@runtime_checkable
class RolloutEngine(Protocol):
    """Generation plus weight updates: everything the loop, the schedules and the weight sync call on an engine,
    implemented by ``HFEngine`` (``engines/hf.py``) and ``SGLangEngine`` (``engines/sglang/client.py``). ``EngineBase``
    below gives the parts an engine without servers has nothing to do for."""

    tokenizer: TokenizerInfo | None  # EOS and stop ids, decoding (the partial schedule ends a sample on them)
    step_restarts: int  # servers restarted since ``new_step`` (a metric; 0 without servers)
    resync: Callable[[list], None] | None  # called with the restarted servers: the loop sends them the weights

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, n: int = 1) -> list[Sample]:
        """``n`` samples per prompt, grouped in prompt order: [p0s0..p0s(n-1), p1s0, ...]."""
        ...

    def generate_stream(self, prompts: list[list[int]], sampling: SamplingParams, n: int = 1) -> Iterator[list[Sample]]:
        """Complete groups (lists of ``n`` Samples of one prompt, in sample order) as they finish, in any order."""
        ...

    def generate_requests(self, requests: list[GenRequest], sampling: SamplingParams) -> Iterator[Sample]:
        """One sample per request as each finishes (``prompt_index`` = the request's position); after ``abort()`` the
        rest come back with finish_reason 'abort' and the tokens they have so far (partial rollout resumes them)."""
        ...

    def update_weights(self, buckets: Iterable[Bucket], version: int) -> None: ...

    def abort(self) -> None:
        """Stop everything in flight; unfinished samples end with finish_reason 'abort'."""
        ...

    def sleep(self) -> None:
        """Release accelerator memory (colocated training); a no-op on CPU."""
        ...

    def wake(self) -> None: ...

    def health(self) -> bool: ...

    def new_step(self) -> None:
        """A training step begins: per-step budgets (server restarts) start again."""
        ...

    def shutdown(self) -> None:
        """Abort what is in flight and stop what the engine started."""
        ...

    def stream_lanes(self) -> tuple[int, int]:
        """(lanes, requests per call) for the streaming producer (``loop/stream_schedule.py``): how many
        ``generate_requests`` calls may run at once and how many requests each takes. A server engine takes one request
        per call on as many lanes as it runs at once; an in-process engine one lane of batches."""
        ...

    @property
    def weight_version(self) -> int: ...


class EngineBase:
    """Defaults for an engine without servers (in process, or a test's stand-in): nothing to restart or stop."""

    tokenizer: TokenizerInfo | None = None
    step_restarts: int = 0
    resync: Callable[[list], None] | None = None

    def new_step(self) -> None:
        self.step_restarts = 0

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def shutdown(self) -> None:
        self.abort()

    def abort(self) -> None:
        pass

    def stream_lanes(self) -> tuple[int, int]:
        return 1, 64


# ----------------------------------------------------------------------------------------------------------------------
# Fidelity: rollout logprobs vs actor logprobs


def logprob_gap(rollout_logprobs: Any, actor_logprobs: Any, mask: Any = None) -> tuple[float, float]:
    """(mean, max) of |logp_rollout - logp_actor| over the valid (mask != 0) tokens; (0, 0) when none is valid.

    Accepts tensors of equal shape (e.g. [batch, seq]) or nested lists; ``mask`` defaults to all tokens."""
    import torch

    a = torch.as_tensor(rollout_logprobs, dtype=torch.float64)
    b = torch.as_tensor(actor_logprobs, dtype=torch.float64)
    if a.shape != b.shape:
        raise ValueError(f"logprob_gap: rollout logprobs {tuple(a.shape)} vs actor logprobs {tuple(b.shape)}")
    m = torch.ones_like(a, dtype=torch.bool) if mask is None else torch.as_tensor(mask).to(torch.bool)
    if m.shape != a.shape:
        raise ValueError(f"logprob_gap: mask {tuple(m.shape)} vs logprobs {tuple(a.shape)}")
    diff = (a - b).abs()[m]
    if diff.numel() == 0:
        return 0.0, 0.0
    return float(diff.mean()), float(diff.max())


def check_logprob_gap(mean_gap: float, alarm: float, step: int | None = None) -> None:
    """Raise ``LogprobGapError`` when ``alarm`` > 0 and the mean gap exceeds it (or is not finite)."""
    if alarm <= 0:
        return
    if not math.isfinite(mean_gap) or mean_gap > alarm:
        where = f" at step {step}" if step is not None else ""
        raise LogprobGapError(
            f"mean |logp_rollout - logp_actor| = {mean_gap:.4g}{where} exceeds rollout.logp_gap_alarm = {alarm}: "
            "the rollout engine is not sampling from the policy being trained (stale or corrupted weights, "
            "a dtype/kernel mismatch, or a wrong tokenizer); set rollout.logp_gap_alarm=0 to disable this check"
        )
