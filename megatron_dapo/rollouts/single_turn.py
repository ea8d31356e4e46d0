"""The default rollout written as a rollout function: one continuation of the prompt. The engine's batched
generation (``rollout.generate: null``) gives the same tokens for the same seeds; this is the template to start from.

    rollout:
      generate: megatron_dapo.rollouts.single_turn:generate
"""

from __future__ import annotations

from megatron_dapo.types import RolloutInput, RolloutOutput, SamplingParams


def generate(client, item: RolloutInput, sampling: SamplingParams) -> RolloutOutput:
    s = client.generate(item.prompt_ids, sampling.max_new_tokens, seed=item.seed)
    return RolloutOutput(list(s.response_ids), list(s.logprobs), None, s.finish_reason)
