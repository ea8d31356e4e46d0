"""vLLM's share of a GPU, term by term, from vLLM's own code (vllm 0.32.0; paths relative to site-packages/vllm/).
Pure arithmetic: nothing here imports vllm. A projection, not a measurement: the planner and ``dapo rehearse`` use it
for the rollout side of a GPU; on GPUs vLLM logs its own numbers at start ("Available KV cache memory").

How one vLLM TP rank fills its GPU at start-up (v1/worker/gpu_worker.py):

1. ``requested = ceil(total × gpu_memory_utilization)`` (v1/worker/utils.py:716-726): a fraction of the GPU's TOTAL
   memory, not of what is free (unlike SGLang's mem_fraction), and start-up fails unless that much is free then
   (:740-745). The process's CUDA context comes before the snapshot and is outside it.
2. The weights load; a profiling forward of ``max_num_batched_tokens`` dummy tokens measures the activation peak
   (``profile_run``, gpu_worker.py:690-693); ``non_kv_cache_memory`` = weights + that peak + non-torch memory
   (NCCL buffers) (:730-742).
3. KV cache = ``requested − non_kv_cache_memory`` (:740-743); blocks of 16 tokens × 2 (K, V) × kv heads per rank ×
   head_dim × layers × dtype.
4. CUDA graphs are captured afterwards, outside ``requested`` unless ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``
   (:700-710): vLLM's own estimate is ``profile_cudagraph_memory()``; here 2 MB per captured decode batch size
   (SGLang's figure for the same graphs, engines/sglang/memory.py), up to ``max_num_seqs`` 512 sizes at most.

Defaults of the OpenAI server on H100/H200-class GPUs (engine/arg_utils.py:2925-2943): max_num_batched_tokens 8192,
max_num_seqs 1024; under 70 GiB: 2048 and 256."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_dapo.engines.sglang.memory import CUDA_CONTEXT_BYTES, kv_cell_bytes

GiB, MiB = 1 << 30, 1 << 20
DEFAULT_UTILIZATION = 0.92  # config/cache.py:102
GRAPH_MB_PER_BS = 2
MAX_GRAPH_SIZES = 512


def default_batch(gpu_total_bytes: float) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) of the OpenAI server (engine/arg_utils.py:2925-2953)."""
    return (8192, 1024) if gpu_total_bytes >= 70 * GiB else (2048, 256)


def activation_bytes(arch, tp: int, tokens: int, seqs: int) -> float:
    """The profiling forward's peak, estimated: per token the widest intermediates of one layer at a time (the gated
    MLP's [2F/TP] and its activation [F/TP], the QKV output, the hidden state twice) in bf16, plus the sampler's fp32
    logits and log-softmax of ``seqs`` rows over the vocabulary / TP."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    qkv = (arch.num_attention_heads + 2 * arch.num_query_groups) * arch.head_dim
    per_token = 2 * (3 * f / tp + qkv / tp + 2 * h)
    return tokens * per_token + 2 * 4 * seqs * arch.vocab_size / tp


@dataclass(frozen=True)
class VLLMMemory:
    """One TP rank of a vLLM server: its settings as vLLM resolves them and its bytes, term by term."""

    LABEL: ClassVar[str] = "vLLM"  # how tables name the engine

    mem_fraction: float  # gpu_memory_utilization
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_tokens: int
    context: float
    weights: float
    kv_cache: float
    activations: float
    cuda_graphs: float

    @property
    def terms(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("context", "weights", "kv_cache", "activations", "cuda_graphs")}

    @property
    def startup(self) -> float:
        """All of it: the activation peak is inside the requested memory from the profiling run on."""
        return sum(self.terms.values())

    @property
    def rollout(self) -> float:
        return self.startup

    @property
    def outside_mem_fraction(self) -> float:
        return self.context + self.cuda_graphs

    def rows(self, tp: int, phase: str) -> list[tuple[str, float, str]]:
        util = f"gpu_memory_utilization {self.mem_fraction:.2f} × the GPU"
        return [
            ("vLLM weights", self.weights, f"the whole model (bf16) / TP{tp}"),
            ("vLLM KV cache", self.kv_cache, f"{util} − weights − activations: {self.kv_tokens:,} tokens/engine"),
            ("vLLM activations", self.activations,
             f"the profiling forward of {self.max_num_batched_tokens:,} tokens (estimated)"),
            ("vLLM CUDA graphs", self.cuda_graphs, f"2 MB × {min(self.max_num_seqs, MAX_GRAPH_SIZES)} batch sizes"),
            ("vLLM runtime", self.context, "its CUDA context"),
        ]  # fmt: skip


def vllm_arch_terms(arch, tp: int, gpu_total_bytes: float, mem_fraction: float | None, **_) -> VLLMMemory:
    """vLLM's bytes on one GPU of a TP-``tp`` server for a model of ours: bf16 weights of the whole model / TP, bf16
    KV cache, the OpenAI server's batch defaults for this GPU."""
    from megatron_dapo.models.memory import BF16, total_params

    util = DEFAULT_UTILIZATION if mem_fraction is None else mem_fraction
    tokens, seqs = default_batch(gpu_total_bytes)
    weights = BF16 * total_params(arch) / tp
    acts = activation_bytes(arch, tp, tokens, seqs)
    cell = kv_cell_bytes(arch.num_layers, arch.num_query_groups, arch.head_dim, tp, BF16)
    kv = max(0.0, util * gpu_total_bytes - weights - acts)
    kv_tokens = int(kv // cell) // 16 * 16
    return VLLMMemory(
        mem_fraction=util,
        max_num_batched_tokens=tokens,
        max_num_seqs=seqs,
        kv_tokens=kv_tokens,
        context=CUDA_CONTEXT_BYTES,
        weights=weights,
        kv_cache=kv_tokens * cell,
        activations=acts,
        cuda_graphs=GRAPH_MB_PER_BS * min(seqs, MAX_GRAPH_SIZES) * MiB,
    )


def fit_mem_fraction(arch, tp: int, gpu_total_bytes: float, startup_room: float, rollout_room: float | None = None,
                     **_) -> float:  # fmt: skip
    """The largest gpu_memory_utilization (2 decimals) whose server fits ``startup_room`` and ``rollout_room``
    (vLLM's footprint is the same in both); 0.0 when none does (the weights and activations alone do not fit)."""
    room = startup_room if rollout_room is None else min(startup_room, rollout_room)
    probe = vllm_arch_terms(arch, tp, gpu_total_bytes, 0.5)
    fraction = min(int((room - probe.outside_mem_fraction) / gpu_total_bytes * 100) / 100, 0.99)
    if fraction <= 0 or vllm_arch_terms(arch, tp, gpu_total_bytes, fraction).kv_tokens < 16:
        return 0.0
    return fraction
