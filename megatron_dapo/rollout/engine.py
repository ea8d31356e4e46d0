"""The rollout-engine contract shared by the CPU (HF transformers) and GPU (SGLang) engines.

    engine.update_weights(buckets, version)                 # buckets: iterable of [(hf_name, full tensor), ...]
    for group in engine.generate_stream(prompts, sampling, n=G):
        keep(group)                                         # n Samples of one prompt, as soon as they are all done
        if enough: engine.abort(); break                    # drop the surplus still in flight

Logprob convention (both engines): ``Sample.logprobs[i]`` is the log-probability of ``response_ids[i]`` under the
distribution the token was sampled from, ``log_softmax(logits / T)`` at the sampling temperature T over the full
vocabulary, before top-p / top-k truncation (T = 1 for greedy decoding). The actor computes the same (its logits
divided by ``rollout.sampling.temperature``) for π_old and π_θ, so the importance ratios are of the sampling policy
and the gap between the two (``logprob_gap``) measures rollout/training numerical mismatch only. SGLang returns
exactly this when ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is unset or 0 (sglang 0.5.23 srt/layers/sampler.py:275 divides
the logits by T before the log-softmax it returns; with the variable set to 1 it returns the untempered one, :231-237).
A stop or EOS token that ends a sample IS included in ``response_ids`` (and has a logprob): the policy must learn
to emit it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]
Bucket = Sequence[tuple[str, Any]]  # [(hf_name, torch.Tensor)], full (unsharded) tensors in HF naming


class RolloutError(RuntimeError):
    """A rollout engine failed (server down and not recoverable, bad request, ...)."""


class WeightSyncError(RuntimeError):
    """A weight sync failed or its verification found a tensor that differs; the message names the tensor."""


class LogprobGapError(RuntimeError):
    """The rollout engine's logprobs drifted from the actor's beyond ``rollout.logp_gap_alarm``."""


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = off
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()  # in addition to the tokenizer's EOS ids
    seed: int | None = None  # None = nondeterministic
    logprobs: bool = True

    def __post_init__(self) -> None:
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature = {self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p = {self.top_p}: must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens = {self.max_new_tokens}: must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_config(cls, s: Any, **overrides: Any) -> SamplingParams:
        """From ``config.SamplingConfig`` (temperature, top_p, top_k, max_new_tokens) plus overrides."""
        kwargs = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "max_new_tokens": s.max_new_tokens}
        kwargs.update(overrides)
        return cls(**kwargs)


def sample_seed(seed: int | None, prompt_index: int, sample_index: int) -> int | None:
    """The seed of one sample: a function of (request seed, prompt position in the call, sample index) only, so a
    sample does not change with batch size or with the other prompts in the call."""
    if seed is None:
        return None
    x = (int(seed) * 0x9E3779B1 + prompt_index * 0x85EBCA77 + sample_index * 0xC2B2AE3D) & 0xFFFFFFFFFFFF
    x ^= x >> 17
    return (x * 0x27D4EB2F) & 0x7FFFFFFF


@dataclass
class TokenizerInfo:
    """What an engine needs from the tokenizer: end-of-sequence ids, the pad id, and optionally a decoder."""

    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    decode: Callable[[list[int]], str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.eos_token_ids, int):
            self.eos_token_ids = (self.eos_token_ids,)
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)

    @classmethod
    def from_hf(cls, tokenizer: Any) -> TokenizerInfo:
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        return cls(
            eos_token_ids=(eos,) if isinstance(eos, int) else tuple(eos or ()),
            pad_token_id=int(pad if pad is not None else 0),
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        )

    def text(self, ids: list[int]) -> str:
        return self.decode(ids) if self.decode is not None else ""


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # of each response token at T=1, unmodified distribution (see module doc)
    finish_reason: FinishReason
    text: str = ""
    prompt_index: int = 0  # position of the prompt in the generate call = the group index
    sample_index: int = 0  # 0..n-1 within the group
    weight_version: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class GenRequest:
    """One sample to generate with its own input, token budget and seed (partial rollout, ``rollout/schedule.py``):
    a fresh sample's input is its prompt; a resumed one's is the prompt + the response it has so far, with the budget
    it has left. Requests with the same ``route`` go to the same server (a group's samples: one prompt prefill)."""

    input_ids: list[int]
    max_new_tokens: int
    seed: int | None = None
    route: int = 0


@runtime_checkable
class RolloutEngine(Protocol):
    """Generation plus weight updates; implemented by ``HFEngine`` (CPU) and ``SGLangEngine`` (GPU)."""

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, n: int = 1) -> list[Sample]:
        """``n`` samples per prompt, grouped in prompt order: [p0s0..p0s(n-1), p1s0, ...]."""
        ...

    def generate_stream(self, prompts: list[list[int]], sampling: SamplingParams, n: int = 1) -> Iterator[list[Sample]]:
        """Complete groups (lists of ``n`` Samples of one prompt, in sample order) as they finish, in any order."""
        ...

    def update_weights(self, buckets: Iterable[Bucket], version: int) -> None: ...

    # partial rollout (rollout.partial) also needs, in both engines:
    # generate_requests(requests: list[GenRequest], sampling) -> Iterator[Sample]: one sample per request as each
    # finishes (prompt_index = the request's position); after abort() the rest come back, finish_reason 'abort',
    # with the tokens they have so far

    def abort(self) -> None:
        """Stop everything in flight; unfinished samples end with finish_reason 'abort'."""
        ...

    def sleep(self) -> None:
        """Release accelerator memory (colocated training); a no-op on CPU."""
        ...

    def wake(self) -> None: ...

    def health(self) -> bool: ...

    @property
    def weight_version(self) -> int: ...


def group_samples(samples: list[Sample], n: int) -> list[list[Sample]]:
    """Split a flat, grouped ``generate`` result into groups of ``n``."""
    if len(samples) % n:
        raise ValueError(f"{len(samples)} samples are not a multiple of n = {n}")
    return [samples[i : i + n] for i in range(0, len(samples), n)]


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
