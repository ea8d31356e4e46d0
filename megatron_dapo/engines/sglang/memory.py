"""SGLang's share of a GPU, term by term, from SGLang's own code (sglang 0.5.23; paths below are relative to the
installed package, ``site-packages/sglang/``). Pure arithmetic: nothing here imports sglang;
``tests/unit/test_sglang_memory.py`` runs the cited sglang functions (with a mocked GPU) and compares.

How one SGLang TP rank fills its GPU at start-up (``srt/managers/scheduler.py:1128-1146``: weights, then the KV pools;
then the attention backends and the CUDA graphs):

1. ``pre`` = the free memory when the server starts, before its weights load, the MIN over the TP ranks
   (``srt/distributed/bootstrap.py:193-222``; ``get_available_gpu_memory``, ``srt/utils/common.py:427-576``:
   ``torch.cuda.mem_get_info`` after ``empty_cache``, all-reduced with MIN, in GiB). What the process took before it
   (its CUDA context) and whatever else is resident on the GPU then is not in ``pre``.
2. Weights + KV cache = ``mem_fraction × pre``: the KV pool gets the free memory after the weights loaded minus the
   slack ``pre × (1 − mem_fraction)`` (``srt/mem_cache/kv_cache_configurator.py:3000-3060``), i.e. ``mem_fraction``
   is a fraction of the memory free at start, NOT of the GPU: a server that starts next to a resident trainer gets
   ``mem_fraction`` of what the trainer left. Tokens = bytes // cell size, page-aligned
   (``srt/model_executor/pool_configurator.py:637-647``); cell = kv heads per rank × (head_dim + v_head_dim) × layers ×
   dtype bytes (``pool_configurator.py:491-498``; heads per rank ``max(1, kv_heads // tp)``,
   ``srt/configs/model_config.py:1700-1711``).
3. The request→token table, allocated after the KV budget was taken, so out of the slack: int32
   [max_running_requests + 1, context_len + 4] (``srt/mem_cache/memory_pool.py:402-407``,
   ``kv_cache_configurator.py:1771-1774``, ``srt/mem_cache/allocation_sizing.py:105``); max_running_requests from
   the KV tokens (``kv_cache_configurator.py:3118-3132``). With Qwen2.5's 131,072-token context: ~1 GiB per GPU.
4. CUDA graphs, out of the slack. SGLang measures them only when it captures them (``Capture ... CUDA graph end.
   mem usage=`` in ``srt/model_executor/model_runner_components/cuda_graph_setup.py:680-699``); its own estimate,
   the one it reserves when it picks ``mem_fraction`` itself (``srt/arg_groups/memory_hook.py:357-399``): 2 MB per
   decode batch size of ``cuda_graph_max_bs`` and 8 MB per captured prefill size.
5. Runtime workspace, out of the slack: SGLang's reserve (``memory_hook.py:308-312``): 512 MB of constant metadata
   ("e.g. from attention backend"), ``tp·pp/8`` GiB for large parallel sizes, and 1.5 MB per token of the prefill chunk
   for the activations — "a heuristic value" (``memory_hook.py:69``), not a measurement: a budget, an upper bound for
   dense models of Qwen2.5's size.

Not in SGLang's code: the CUDA context (``CUDA_CONTEXT_BYTES``) and how much memory a GPU kind really has
(``models.gpus.GPU_MEMORY_MIB``): an "80 GB" H100 has 81,559 MiB = 79.65 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

GiB, MiB = 1 << 30, 1 << 20

# The CUDA context of the server's process (driver state and the kernels loaded), outside torch's allocator and
# outside ``pre``. Not from SGLang's code: ~400 MB with CUDA >= 11.7 and lazy module loading (PyTorch's default), as
# NVIDIA's ptrblck puts it in pytorch/pytorch#109888; rounded up.
CUDA_CONTEXT_BYTES = 512 * MiB

# SGLang's constants (srt/arg_groups/memory_hook.py)
METADATA_MB = 512  # :309 "Constant meta data (e.g., from attention backend)"
ACTIVATION_MB_PER_TOKEN = 1.5  # :310 × the prefill chunk's tokens; "a heuristic value" (:69)
MIN_ACTIVATION_TOKENS = 2048  # :305
DECODE_GRAPH_MB_PER_BS = 2  # :368
PREFILL_GRAPH_MB_PER_SIZE = 8  # :386 (non-MLA; "only non-torch memory is counted")
RESERVE_FLOOR_MB = 10 * 1024  # :314-315, GPUs over 60 GiB, when SGLang picks mem_fraction itself
REQ_TO_TOKEN_EXTRA = 4  # srt/mem_cache/allocation_sizing.py:105 (no speculative decoding)


# ----------------------------------------------------------------------------------------------------------------------
# SGLang's defaults (srt/arg_groups/memory_hook.py handle_gpu_memory_settings), from the GPU's memory in MiB


def default_chunked_prefill_size(gpu_mib: float) -> int:
    """``--chunked-prefill-size`` unset: 2k under 20 GiB, 4k under 60, 8k under 160, else 16k (memory_hook.py:89-170)."""
    if gpu_mib < 20 * 1024:
        return 2048
    if gpu_mib < 60 * 1024:
        return 4096
    return 8192 if gpu_mib < 160 * 1024 else 16384


def default_cuda_graph_max_bs(gpu_mib: float, tp: int, max_running_requests: int | None = None) -> int:
    """``--cuda-graph-max-bs`` unset (memory_hook.py:89-188): 8 under 20 GiB; 48/160 (TP < 4 / TP >= 4) under 35;
    32/160 under 60; 256/512 under 160 (H100, H200); 512 beyond; then capped by ``--max-running-requests``."""
    if gpu_mib < 20 * 1024:
        bs = 8
    elif gpu_mib < 35 * 1024:
        bs = 48 if tp < 4 else 160
    elif gpu_mib < 60 * 1024:
        bs = 32 if tp < 4 else 160
    elif gpu_mib < 160 * 1024:
        bs = 256 if tp < 4 else 512
    else:
        bs = 512
    return min(bs, max_running_requests) if max_running_requests is not None else bs


def prefill_cuda_graph_sizes(max_tokens: int) -> list[int]:
    """The prefill token counts SGLang captures up to ``max_tokens`` (= the chunk size by default, memory_hook.py:
    233-236): ``generate_prefill_cuda_graph_batch_sizes``, srt/arg_groups/cuda_graph_hook.py:480-497."""
    sizes = (
        list(range(4, 33, 4))
        + list(range(48, 257, 16))
        + list(range(288, 513, 32))
        + list(range(576, 1025, 64))
        + list(range(1280, 4097, 256))
        + list(range(4608, max_tokens + 1, 512))
    )
    return [s for s in sizes if s <= max_tokens]


def cuda_graph_bytes(cuda_graph_max_bs: int, prefill_graph_tokens: int = 0) -> float:
    """SGLang's estimate of its CUDA graphs (``reserve_for_graph_mb``, memory_hook.py:357-399, dense model, no DP
    attention): 2 MB × decode ``cuda_graph_max_bs`` (:368) + 8 MB per captured prefill size (:386) when prefill graphs
    are on (``prefill_graph_tokens`` > 0: the largest captured prefill, the chunk size by default).

    Prefill graphs: SGLang's CUDA default is the "breakable" backend (srt/model_executor/cuda_graph_config.py:119-
    122), but a colocated server (``--enable-memory-saver`` with SGLANG_MEMORY_SAVER_CUDA_GRAPH=1, what
    ``engines/sglang/server.py`` sets) cannot run it: BreakableCudaGraphBackend raises NotImplementedError
    ("Breakable CUDA graph is not compatible with memory saver mode", srt/model_executor/runner_backend/
    breakable_cuda_graph_backend.py:84-94), so such a server needs ``--disable-prefill-cuda-graph`` and has none."""
    prefill = len(prefill_cuda_graph_sizes(prefill_graph_tokens)) if prefill_graph_tokens > 0 else 0
    return (DECODE_GRAPH_MB_PER_BS * cuda_graph_max_bs + PREFILL_GRAPH_MB_PER_SIZE * prefill) * MiB


def activation_bytes(chunked_prefill_size: int) -> float:
    """SGLang's activation reserve: 1.5 MB per token of the prefill chunk, at least 2048 tokens (memory_hook.py:
    304-310; the coefficient is "a heuristic value", :69). 12 GiB at the 8k chunk of an H100."""
    return ACTIVATION_MB_PER_TOKEN * max(chunked_prefill_size, MIN_ACTIVATION_TOKENS) * MiB


def parallel_bytes(tp: int, pp: int = 1) -> float:
    """SGLang's "adjustments for large parallel size": tp·pp/8 GiB (memory_hook.py:311-312; 0.5 GiB at TP4)."""
    return tp * pp / 8 * 1024 * MiB


def default_mem_fraction(
    gpu_mib: float,
    tp: int,
    *,
    chunked_prefill_size: int | None = None,
    cuda_graph_max_bs: int | None = None,
    prefill_graph_tokens: int | None = None,
    pp: int = 1,
) -> float:
    """``--mem-fraction-static`` unset (memory_hook.py:281-328, not post-capture sized — it is not with
    ``--enable-memory-saver``, srt/arg_groups/overrides.py:1813): round((gpu − reserve) / gpu, 3), reserve = 512 MB +
    1.5 MB × max(chunk, 2048) + tp·pp/8 GiB + the CUDA-graph estimate, at least 10 GiB on GPUs over 60 GiB.
    ``prefill_graph_tokens`` None: prefill graphs on, up to the chunk (SGLang's CUDA default); 0: off."""
    chunk = chunked_prefill_size or default_chunked_prefill_size(gpu_mib)
    bs = cuda_graph_max_bs or default_cuda_graph_max_bs(gpu_mib, tp)
    prefill = chunk if prefill_graph_tokens is None else prefill_graph_tokens
    reserve_mb = (
        METADATA_MB
        + ACTIVATION_MB_PER_TOKEN * max(chunk, MIN_ACTIVATION_TOKENS)
        + tp * pp / 8 * 1024
        + cuda_graph_bytes(bs, prefill) / MiB
    )
    if gpu_mib > 60 * 1024:
        reserve_mb = max(reserve_mb, RESERVE_FLOOR_MB)
    return round((gpu_mib - reserve_mb) / gpu_mib, 3)


# ----------------------------------------------------------------------------------------------------------------------
# The KV cache and the request table


def kv_cell_bytes(num_layers: int, num_kv_heads: int, head_dim: int, tp: int, dtype_bytes: int = 2) -> int:
    """KV bytes per token on one TP rank (MHA pool): max(1, kv_heads // tp) × (head_dim + v_head_dim) × layers ×
    dtype (pool_configurator.py:491-498, model_config.py:1700-1711); K and V both ``head_dim`` wide."""
    return max(1, num_kv_heads // tp) * 2 * head_dim * num_layers * dtype_bytes


def kv_cache_bytes(free_at_start: float, mem_fraction: float, weights: float, other_loaded: float = 0.0) -> float:
    """The KV pool's budget: the free memory after loading (``free_at_start − weights − other_loaded``) less the slack
    ``free_at_start × (1 − mem_fraction)`` = ``mem_fraction × free_at_start − weights − other_loaded``
    (kv_cache_configurator.py:3000-3060); <= 0: SGLang refuses to start (:3043-3058)."""
    return (free_at_start - weights - other_loaded) - free_at_start * (1 - mem_fraction)


def kv_tokens(kv_bytes: float, cell_bytes: int, page_size: int = 1) -> int:
    """Tokens of the pool: bytes // cell, down to whole pages (pool_configurator.py:637-647)."""
    return int(max(kv_bytes, 0) // cell_bytes) // page_size * page_size


def max_running_requests(tokens: int, context_len: int, requested: int | None = None) -> int:
    """Request slots (``resolve_max_num_reqs``, kv_cache_configurator.py:3118-3132, dp 1, no Mamba): with
    ``--max-running-requests`` min(it, tokens // 2); else tokens / context_len × 512 clamped to [2048, 4096], at most
    tokens // 2."""
    if requested is not None:
        return min(max(1, requested), tokens // 2)
    estimated = max(min(int(tokens / context_len * 512), 4096), 2048)
    return min(estimated, tokens // 2)


def req_to_token_bytes(max_requests: int, context_len: int) -> int:
    """The request→token table: int32 [max_requests + 1, context_len + 4] (memory_pool.py:402-407,
    kv_cache_configurator.py:1771-1774, allocation_sizing.py:105)."""
    return 4 * (max_requests + 1) * (context_len + REQ_TO_TOKEN_EXTRA)


# ----------------------------------------------------------------------------------------------------------------------
# One GPU, term by term


STARTUP_TERMS = ("context", "weights", "kv_cache", "req_to_token", "cuda_graphs", "metadata", "parallel")
ROLLOUT_TERMS = STARTUP_TERMS + ("activations",)
WHY = {
    "context": "CUDA context of the server process (not SGLang's code: pytorch#109888)",
    "weights": "the whole model / TP",
    "kv_cache": "mem_fraction × free memory at start − weights (kv_cache_configurator.py:3007,3038)",
    "req_to_token": "int32 [requests + 1, context + 4] (memory_pool.py:402-407), outside mem_fraction",
    "cuda_graphs": "2 MB × cuda_graph_max_bs + 8 MB per prefill graph (memory_hook.py:368,386)",
    "metadata": "attention-backend metadata, 512 MB (memory_hook.py:309)",
    "parallel": "tp·pp/8 GiB for the parallel groups (memory_hook.py:312)",
    "activations": "1.5 MB × prefill chunk tokens: SGLang's heuristic reserve (memory_hook.py:310)",
}


@dataclass(frozen=True)
class SGLangMemory:
    """One TP rank of an SGLang server: its settings as SGLang resolves them and its bytes, term by term."""

    LABEL: ClassVar[str] = "SGLang"  # how tables name the engine

    mem_fraction: float
    chunked_prefill_size: int
    cuda_graph_max_bs: int
    prefill_graph_tokens: int  # 0: no prefill CUDA graphs
    kv_tokens: int
    max_running_requests: int
    context: float
    weights: float
    kv_cache: float
    req_to_token: float
    cuda_graphs: float
    metadata: float
    parallel: float
    activations: float

    @property
    def terms(self) -> dict[str, float]:
        """Every byte term (``ROLLOUT_TERMS``)."""
        return {k: getattr(self, k) for k in ROLLOUT_TERMS}

    @property
    def startup(self) -> float:
        """Held once the server is up (weights, KV pool, request table, graphs captured, backends initialized)."""
        return sum(getattr(self, k) for k in STARTUP_TERMS)

    @property
    def rollout(self) -> float:
        """At the peak of generation: ``startup`` + the activations of a full prefill chunk (SGLang's reserve)."""
        return self.startup + self.activations

    @property
    def outside_mem_fraction(self) -> float:
        """What the server takes beyond ``mem_fraction × free memory at start`` during generation."""
        return self.rollout - self.weights - self.kv_cache

    def rows(self, tp: int, phase: str) -> list[tuple[str, float, str]]:
        """The rows of a phase's memory table (``models.memory``): start-up holds the weights, KV pool, request
        table, CUDA graphs and runtime state; generation (``rollout``) adds the activations of a prefill chunk."""
        runtime = self.context + self.metadata + self.parallel
        pool = f"mem_fraction {self.mem_fraction:.2f} × the memory free at server start"
        rows = [("SGLang weights", self.weights, f"the whole model (bf16) / TP{tp}"),
                ("SGLang KV cache", self.kv_cache, f"{pool} − weights: {self.kv_tokens:,} tokens/engine")]  # fmt: skip
        if phase == "startup":
            rows = [
                ("SGLang weights + KV", self.weights + self.kv_cache, f"{pool}: {self.kv_tokens:,} KV tokens/engine")
            ]
        rows += [
            ("SGLang request table", self.req_to_token,
             f"int32 [{self.max_running_requests:,} requests + 1, context + 4]"),
            ("SGLang CUDA graphs", self.cuda_graphs, f"SGLang's estimate for cuda_graph_max_bs {self.cuda_graph_max_bs}"),
            ("SGLang runtime", runtime, "its CUDA context, attention metadata, parallel groups"),
        ]  # fmt: skip
        if phase == "rollout":
            rows.append(("SGLang activations", self.activations,
                         f"SGLang's reserve for a {self.chunked_prefill_size:,}-token chunk"))  # fmt: skip
        return rows


def sglang_gpu_terms(
    weights_bytes: float,
    gpu_total_bytes: float,
    mem_fraction: float | None,
    tp: int,
    kv_bytes_per_token: int,
    context_len: int,
    *,
    cuda_graph_max_bs: int | None = None,
    chunked_prefill_size: int | None = None,
    prefill_cuda_graph: bool = False,
    max_running_requests_cap: int | None = None,
    free_at_start: float | None = None,
    context_bytes: float = CUDA_CONTEXT_BYTES,
    pp: int = 1,
    page_size: int = 1,
) -> SGLangMemory:
    """SGLang's bytes on one GPU of a TP-``tp`` server. ``weights_bytes``: its shard of the model; ``kv_bytes_per_token``:
    ``kv_cell_bytes``; ``context_len``: the server's (the HF config's max_position_embeddings unless
    ``--context-length``). Unset ``mem_fraction`` / ``cuda_graph_max_bs`` / ``chunked_prefill_size``: SGLang's
    defaults for this GPU (GiB from ``gpu_total_bytes``, as nvidia-smi reports it). ``prefill_cuda_graph``: False for a
    colocated server (see ``cuda_graph_bytes``). ``free_at_start``: free memory when the server starts (default: the
    whole GPU less its own CUDA context — the server starts before the trainer, as ``dapo launch`` starts them; a
    trainer already resident leaves less, and ``mem_fraction`` applies to what it leaves)."""
    gpu_mib = gpu_total_bytes / MiB
    chunk = chunked_prefill_size or default_chunked_prefill_size(gpu_mib)
    bs = cuda_graph_max_bs or default_cuda_graph_max_bs(gpu_mib, tp, max_running_requests_cap)
    prefill = chunk if prefill_cuda_graph else 0
    mf = mem_fraction
    if mf is None:
        mf = default_mem_fraction(gpu_mib, tp, chunked_prefill_size=chunk, cuda_graph_max_bs=bs,
                                  prefill_graph_tokens=prefill, pp=pp)  # fmt: skip
    pre = free_at_start if free_at_start is not None else gpu_total_bytes - context_bytes
    tokens = kv_tokens(kv_cache_bytes(pre, mf, weights_bytes), kv_bytes_per_token, page_size)
    requests = max_running_requests(tokens, context_len, max_running_requests_cap) if tokens >= 2 else 0
    return SGLangMemory(
        mem_fraction=mf,
        chunked_prefill_size=chunk,
        cuda_graph_max_bs=bs,
        prefill_graph_tokens=prefill,
        kv_tokens=tokens,
        max_running_requests=requests,
        context=context_bytes,
        weights=weights_bytes,
        kv_cache=tokens * kv_bytes_per_token,
        req_to_token=req_to_token_bytes(requests, context_len) if requests else 0,
        cuda_graphs=cuda_graph_bytes(bs, prefill),
        metadata=METADATA_MB * MiB,
        parallel=parallel_bytes(tp, pp),
        activations=activation_bytes(chunk),
    )


def sglang_arch_terms(arch, tp: int, gpu_total_bytes: float, mem_fraction: float | None, **kw) -> SGLangMemory:
    """``sglang_gpu_terms`` for a model of ours (``models.arch.ArchConfig``): bf16 weights of the whole model / TP
    (the replicated norms, and the K/V projections replicated when TP > kv heads, neglected), bf16 KV cache, the HF
    config's context length."""
    from megatron_dapo.models.memory import BF16, total_params

    cell = kv_cell_bytes(arch.num_layers, arch.num_query_groups, arch.head_dim, tp, BF16)
    weights = BF16 * total_params(arch) / tp
    return sglang_gpu_terms(weights, gpu_total_bytes, mem_fraction, tp, cell, arch.max_position_embeddings, **kw)


def fit_mem_fraction(
    arch, tp: int, gpu_total_bytes: float, startup_room: float, rollout_room: float | None = None, **kw
) -> float:
    """The largest ``mem_fraction`` (2 decimals) whose server fits the bytes left to it in each phase: ``startup`` <=
    ``startup_room`` (beside the trainer's whole state) and ``rollout`` <= ``rollout_room`` (beside what the trainer
    keeps while generating; None: unchecked); 0.0 when none does. ``kw`` as for ``sglang_gpu_terms``."""
    pre = kw.get("free_at_start") or gpu_total_bytes - kw.get("context_bytes", CUDA_CONTEXT_BYTES)
    probe = sglang_arch_terms(arch, tp, gpu_total_bytes, 0.5, **kw)
    pool = probe.weights + probe.kv_cache
    room = startup_room - (probe.startup - pool)
    if rollout_room is not None:
        room = min(room, rollout_room - (probe.rollout - pool))
    fraction = min(int(room / pre * 100) / 100, 0.99)
    while fraction > 0:  # the request table grows with the KV pool: step down until it fits
        s = sglang_arch_terms(arch, tp, gpu_total_bytes, fraction, **kw)
        if s.startup <= startup_room and (rollout_room is None or s.rollout <= rollout_room):
            return fraction
        fraction = round(fraction - 0.01, 2)
    return 0.0
