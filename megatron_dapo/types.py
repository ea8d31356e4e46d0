"""The data that flows through a run: what the rollout engines take and return (``SamplingParams``, ``GenRequest``,
``Sample``), what the actor trains on (``Sequence``), and the errors a rollout or a weight sync raises. Imports nothing
of the package: every layer may use it.

Logprob convention (every engine): ``Sample.logprobs[i]`` is the log-probability of ``response_ids[i]`` under the
distribution the token was sampled from, ``log_softmax(logits / T)`` at the sampling temperature T over the full
vocabulary, before top-p / top-k truncation (T = 1 for greedy decoding). The actor computes the same (its logits
divided by ``rollout.sampling.temperature``) for π_old and π_θ, so the importance ratios are of the sampling policy
and the gap between the two (``engines.base.logprob_gap``) measures rollout/training numerical mismatch only. SGLang
returns exactly this when ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is unset or 0 (sglang 0.5.23 srt/layers/sampler.py:275
divides the logits by T before the log-softmax it returns; with the variable set to 1 it returns the untempered one,
:231-237). A stop or EOS token that ends a sample IS included in ``response_ids`` (and has a logprob): the policy must
learn to emit it.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

FinishReason = Literal["stop", "length", "abort"]
Bucket = Seq[tuple[str, Any]]  # [(hf_name, torch.Tensor)], full (unsharded) tensors in HF naming


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
    # per response token, 1 = the policy generated it (trained), 0 = inserted by the rollout (a tool's output: not
    # trained, not counted in the entropy, the logprob gap or the overlong length); None = every token generated
    loss_mask: list[int] | None = None
    # MoE routing replay: the experts the engine routed each token to, [prompt + response - 1, MoE layers, top-k]
    # int16 (the last token is never routed for a prediction); None = not asked for (rollout.routing_replay)
    routes: torch.Tensor | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class RolloutInput:
    """What a rollout function (``rollout.generate``) gets for one sample: the tokenized prompt, the row it came from
    and the sample's seed (``sample_seed`` of the step's seed, the prompt and the sample index)."""

    prompt_ids: list[int]
    prompt_text: str
    messages: list[dict]
    ground_truth: str
    metadata: dict  # the row's data_source, index, source and extra fields (tools, extra_info, ...)
    sample_index: int = 0
    seed: int | None = None


@dataclass
class RolloutOutput:
    """What a rollout function returns for one sample. ``logprobs``: the engine's, one per response token (0.0 for
    tokens the policy did not generate); ``loss_mask``: 1 = generated by the policy, 0 = inserted (tool output);
    ``metrics``: numbers averaged per step as ``rollout/<name>`` (turns, tool calls, ...)."""

    response_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int] | None = None
    finish_reason: FinishReason = "stop"
    text: str | None = None  # what the reward function reads; None = the engine's decoding of response_ids
    metrics: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.logprobs) != n:
            raise ValueError(f"rollout output: {len(self.logprobs)} logprobs for {n} response tokens")
        if self.loss_mask is not None:
            if len(self.loss_mask) != n:
                raise ValueError(f"rollout output: a loss mask of {len(self.loss_mask)} for {n} response tokens")
            if any(m not in (0, 1) for m in self.loss_mask):
                raise ValueError("rollout output: loss_mask values must be 0 or 1")


@dataclass
class GenRequest:
    """One sample to generate with its own input, token budget and seed (partial rollout, ``loop/schedule.py``):
    a fresh sample's input is its prompt; a resumed one's is the prompt + the response it has so far, with the budget
    it has left. Requests with the same ``route`` go to the same server (a group's samples: one prompt prefill).
    ``offset``: the response tokens the sample already has: the HF engine continues the sample's random stream there
    (a resumed sample on unchanged weights draws exactly the tokens it would have drawn uninterrupted); a server engine
    draws from a seed derived from (seed, offset), so the continuation never replays the draws of the sample's start."""

    input_ids: list[int]
    max_new_tokens: int
    seed: int | None = None
    route: int = 0
    offset: int = 0


def group_samples(samples: list[Sample], n: int) -> list[list[Sample]]:
    """Split a flat, grouped ``generate`` result into groups of ``n``."""
    if len(samples) % n:
        raise ValueError(f"{len(samples)} samples are not a multiple of n = {n}")
    return [samples[i : i + n] for i in range(0, len(samples), n)]


@dataclass
class Sequence:
    """One prompt + response. Per-response-token fields have length ``len(tokens) - prompt_len``."""

    tokens: torch.Tensor  # [L] int64: prompt then response
    prompt_len: int
    advantage: float = 0.0
    old_logprobs: torch.Tensor | None = None  # [R] fp32 (recomputed by the actor before training)
    rollout_logprobs: torch.Tensor | None = None  # [R] fp32, the rollout engine's (truncated importance sampling)
    loss_mask: torch.Tensor | None = None  # [R] 1 = in the loss (overlong filtering zeroes truncated samples)
    entropy: torch.Tensor | None = None  # [R] of pi_old at each response position (set by train_step)
    tis_mask: torch.Tensor | None = None  # [R] bool: tokens TIS weighs (partial rollout); None = per algo.tis
    generated: torch.Tensor | None = None  # [R] bool: tokens the policy generated (not tool output); None = all
    routes: torch.Tensor | None = None  # [L - 1, MoE layers, top-k] the engine's experts per token (routing replay)

    @property
    def response_len(self) -> int:
        return int(self.tokens.numel()) - self.prompt_len
