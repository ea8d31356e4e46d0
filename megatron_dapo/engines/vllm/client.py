"""The vLLM rollout engine: vLLM servers driven over HTTP (vllm itself is imported by nothing here).

    servers = [VLLMServer(hf_dir, python=".venv-vllm/bin/python", device="cpu", kv_cache_gib=0.25)]
    engine = VLLMEngine(servers, tokenizer_info=tok, resync=lambda dead: weight_sync.sync(export(), v, dead))
    for group in engine.generate_stream(prompts, sampling, n=16): ...
    engine.shutdown()                                        # stops only the processes it started

What the SGLang engine does for a pool of servers (one request per sample, a thread pool per worker, every sample of
a prompt to one worker, restarts and resyncs of a dead server, the abort generations and re-aborts of requests that
reach a worker after an abort) is inherited from ``SGLangEngine``; the wire format is vLLM's (0.32.0, file:line under
site-packages/vllm/):

* ``POST /v1/completions`` with the prompt as token ids, ``return_token_ids`` and ``return_tokens_as_token_ids``
  (entrypoints/openai/completion/protocol.py:52-58,171-180), ``logprobs: 0`` (the sampled token's, of the
  temperature-scaled distribution: server.py), a per-sample ``seed`` and ``request_id``. The engine request id is
  ``cmpl-<request_id>-0`` (completion/serving.py:141,177): what ``/abort_requests`` takes.
* An aborted request answers 200 with the tokens and logprobs it had and ``finish_reason: "abort"``
  (v1/engine/output_processor.py:441-451), as SGLang's does: partial rollout keeps them.
* ``/abort_requests {"request_ids": [...]}``, an empty list aborting everything (entrypoints/serve/rl/online/
  api_router.py:94-139).
* Memory (GPU, colocated; sleep mode): ``/sleep?level=2&mode=wait`` releases weights and KV cache (the next sync
  reloads the weights; v1/engine/core.py:959-995), ``/pause`` + ``/release_kv_cache_memory`` the KV cache alone
  (core.py:1021-1039), ``/wake_up?tags=`` brings tags back, scheduling resuming when all are (core.py:997-1019). On a
  CPU vLLM has no sleep mode (config/model.py:655-657): nothing to release.
"""

from __future__ import annotations

import base64
import io
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megatron_dapo.engines.sglang import types as T
from megatron_dapo.engines.sglang.client import SGLangEngine, _Failed
from megatron_dapo.engines.sglang.routes import RouteLayout
from megatron_dapo.engines.sglang.server import ServerUnavailable, http_call
from megatron_dapo.engines.vllm.server import DTYPE_NAMES, VLLMServer, server_dtype, servers_from_config
from megatron_dapo.types import Bucket, RolloutError, Sample, SamplingParams, TokenizerInfo

log = logging.getLogger(__name__)

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}  # vLLM's finish_reason -> Sample's
MEMORY_TAGS = {"weights": "weights", "kv_cache": "kv_cache"}  # the loop's tags (SGLang's names) -> vLLM's


@dataclass
class CompletionRequest:
    """One sample's ``/v1/completions`` body (and what the engine keeps of it)."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: list[int]
    seed: int | None
    logprobs: bool
    model: str
    routes: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def engine_id(self) -> str:
        return f"cmpl-{self.rid}-0"

    def to_json(self) -> dict:
        body = {
            "model": self.model,
            "prompt": self.input_ids,
            "max_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k if self.top_k > 0 else -1,
            "stop_token_ids": self.stop_token_ids,
            "request_id": self.rid,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if self.seed is not None:
            body["seed"] = int(self.seed) % (1 << 63)
        if self.logprobs:
            body["logprobs"] = 0
        return body | self.extra


class VLLMEngine(SGLangEngine):
    """``RolloutEngine`` over vLLM servers (HTTP)."""

    def __init__(self, servers: Sequence[VLLMServer], *, model_name: str | None = None, **kwargs):
        # the name requests give as "model": the path the servers were started from (vLLM's served model name)
        self.model_name = model_name or next((s.model_path for s in servers if s.model_path), None)
        super().__init__(servers, **kwargs)

    @classmethod
    def from_config(cls, cfg, model_path, tokenizer_info=None, log_dir=None, server_urls=None, start=True):
        r = cfg.rollout
        servers = servers_from_config(cfg, model_path, log_dir, server_urls)
        return cls(
            servers,
            routes=RouteLayout.of(cfg),
            tokenizer_info=tokenizer_info,
            dtype=DTYPE_NAMES[server_dtype(cfg)],
            max_concurrency=r.max_concurrency,
            server_timeout=r.server_timeout_s,
            max_restarts_per_step=r.max_restarts_per_step,
            fanout=r.fanout,
            start=start,
        )

    # -- what the pool needs of a server -------------------------------------------------------------------------------

    def _ensure_pools(self) -> None:
        """A pool of ``max_concurrency`` threads per worker (vLLM schedules what it can hold and queues the rest:
        its --max-num-seqs; an attached server's is not asked), within the open-file limit."""
        import concurrent.futures as cf

        from megatron_dapo.engines.sglang.capacity import fit_open_files, open_file_budget

        new = [s for s in self.servers if s.url not in self.concurrency]
        fitted = fit_open_files({**self.concurrency, **{s.url: self.max_concurrency for s in new}}, open_file_budget())
        for s in new:
            self.concurrency[s.url] = fitted[s.url]
            self._pools[s.url] = cf.ThreadPoolExecutor(self.concurrency[s.url], thread_name_prefix="vllm-req")
        if self.model_name is None and self.servers:
            models = http_call(self.servers[0].url, "/v1/models", timeout=self.server_timeout)
            self.model_name = models["data"][0]["id"]

    # -- requests ------------------------------------------------------------------------------------------------------

    def _request(
        self, prompt: list[int], sp: SamplingParams, seed: int | None, rid: str, max_new_tokens: int | None = None
    ) -> CompletionRequest:
        stop = sorted(set(sp.stop_token_ids) | set(self.tokenizer.eos_token_ids if self.tokenizer else ()))
        return CompletionRequest(
            rid=rid,
            input_ids=list(prompt),
            max_new_tokens=max_new_tokens or sp.max_new_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            stop_token_ids=stop,
            seed=seed,
            logprobs=sp.logprobs,
            model=self.lora_name or str(self.model_name),
            routes=self.routes is not None,
        )

    def _run(self, key: tuple[int, int], req: CompletionRequest, gen: int, url: str) -> Sample | _Failed:
        import concurrent.futures as cf

        with self._abort_gate, self._lock:
            cancelled = self._abort_gen != gen
            if not cancelled:
                self._inflight[req.rid] = (url, gen)
                self.metrics["requests"] += 1
        try:
            if cancelled:
                raise cf.CancelledError
            answer = http_call(url, "/v1/completions", req.to_json(), timeout=self.request_timeout)
        except ServerUnavailable as e:
            return _Failed(key, e)
        except cf.CancelledError:
            answer = {"choices": [{"token_ids": [], "finish_reason": "abort"}]}
        finally:
            with self._lock:
                self._inflight.pop(req.rid, None)
                self._assigned.get(url, set()).discard(req.rid)
        return self._sample(key, req, answer)

    def _sample(self, key: tuple[int, int], req: CompletionRequest, answer: dict) -> Sample:
        try:
            choice = answer["choices"][0]
            ids = [int(t) for t in choice.get("token_ids") or []]
            finish = FINISH[choice.get("finish_reason") or "abort"]
        except (KeyError, IndexError, TypeError) as e:
            raise RolloutError(f"request {req.rid}: not a vLLM completion ({e!r}): {str(answer)[:300]}") from None
        logprobs = [float(x) for x in ((choice.get("logprobs") or {}).get("token_logprobs") or [])]
        if req.logprobs and len(logprobs) != len(ids):
            raise RolloutError(f"request {req.rid}: {len(ids)} output tokens but {len(logprobs)} logprobs")
        if finish == "abort":
            with self._lock:
                self.metrics["aborted"] += 1
        routes = None
        if self.routes is not None and ids:
            routes = decode_routes(self.routes, choice.get("routed_experts"), len(req.input_ids) + len(ids), req.rid)
        return Sample(
            prompt_ids=list(req.input_ids),
            response_ids=ids,
            logprobs=logprobs,
            finish_reason=finish,  # type: ignore[arg-type]
            text=choice.get("text") or (self.tokenizer.text(ids) if self.tokenizer is not None else ""),
            prompt_index=key[0],
            sample_index=key[1],
            weight_version=self._version,  # per-token versions are on /inference/v1/generate only
            meta={"rid": req.rid},
            routes=routes,
        )

    def _abort_calls(self, calls: list[tuple[str, T.AbortRequest]]) -> None:
        """The SGLang engine's abort calls (abort_all, or one rid) in vLLM's form."""
        import concurrent.futures as cf

        if not calls:
            return
        bodies = [(u, {"request_ids": [] if req.abort_all else [f"cmpl-{req.rid}-0"]}) for u, req in calls]
        with cf.ThreadPoolExecutor(max_workers=max(1, min(32, len(bodies)))) as ex:
            for fut in [ex.submit(http_call, u, "/abort_requests", body, 30) for u, body in bodies]:
                try:
                    fut.result()
                except RolloutError as e:
                    log.warning("abort: %s", e)

    # -- memory and weights --------------------------------------------------------------------------------------------

    def wait_idle(self, timeout_s: float = 120.0, poll_s: float = 0.1) -> None:
        """Until no aborted request of this engine is unanswered (vLLM's /pause?mode=wait drains the rest)."""
        import time

        deadline = time.monotonic() + timeout_s
        while self._reabort_stale():
            if time.monotonic() > deadline:
                raise RolloutError(f"aborted requests still unanswered after {timeout_s:.0f} s")
            time.sleep(poll_s)

    def sleep(self, tags: list[str] | None = None, idle_timeout_s: float = 120.0) -> None:
        """Release GPU memory (servers in sleep mode, i.e. rollout.colocate on GPUs); nothing on a CPU."""
        if self.platform.name != "cuda":
            return
        want = [MEMORY_TAGS[t] for t in (tags or MEMORY_TAGS) if t in MEMORY_TAGS]
        self.wait_idle(idle_timeout_s)
        for s in self.servers:
            held = [t for t in want if t not in self._released[s.url]]
            if not held:
                continue
            if "weights" in held:  # level 2: weights and KV cache discarded; the next sync loads the weights
                http_call(s.url, "/sleep?level=2&mode=wait", {}, timeout=idle_timeout_s + self.server_timeout)
                self._released[s.url] |= {"weights", "kv_cache"}
            else:
                http_call(s.url, "/pause?mode=wait&clear_cache=true", {}, timeout=idle_timeout_s + self.server_timeout)
                http_call(s.url, "/release_kv_cache_memory", {}, timeout=self.server_timeout)
                self._released[s.url].add("kv_cache")

    def wake(self, tags: list[str] | None = None) -> None:
        if self.platform.name != "cuda":
            return
        want = [MEMORY_TAGS[t] for t in (tags or MEMORY_TAGS) if t in MEMORY_TAGS]
        for s in self.servers:
            mine = [t for t in ("weights", "kv_cache") if t in want and t in self._released[s.url]]
            if mine:
                query = "&".join(f"tags={t}" for t in mine)
                http_call(s.url, f"/wake_up?{query}", {}, timeout=self.server_timeout)
                self._released[s.url] -= set(mine)

    def released(self, url: str | None = None) -> list[str]:
        mine = self._released[url or self.servers[0].url]
        return [t for t in MEMORY_TAGS if t in mine]

    def asleep(self, url: str) -> bool:
        """The server's scheduler is paused by ``sleep`` (a sync then neither pauses nor resumes it)."""
        return bool(self._released.get(url))

    def update_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        """Protocol method: a plain (unverified) update through safetensors on disk."""
        from megatron_dapo.engines.vllm.sync import VLLMDiskSync

        VLLMDiskSync(self, verify="off").sync(buckets, version)


def decode_routes(layout: RouteLayout, encoded: str | None, seq_len: int, rid: str):
    """vLLM's ``routed_experts`` (base64 of a .npy, [tokens - 1, layers, top-k]: completion/protocol.py:670-679) as
    ``Sample.routes`` ([seq_len - 1, MoE layers, top-k] int16); a missing or misshapen one is a RolloutError."""
    import numpy as np
    import torch

    if not encoded:
        raise RolloutError(f"request {rid}: the server returned no routed experts (rollout.routing_replay); start it "
                           "with --enable-return-routed-experts (dapo's servers get it from the config)")  # fmt: skip
    arr = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    rows = seq_len - 1
    if arr.ndim != 3 or arr.shape[0] != rows or arr.shape[2] != layout.topk:
        raise RolloutError(f"request {rid}: routed experts of shape {arr.shape}, expected ({rows}, layers, "
                           f"{layout.topk})")  # fmt: skip
    if arr.shape[1] == layout.num_layers:
        arr = arr[:, list(layout.moe_layers)]
    elif arr.shape[1] != len(layout.moe_layers):
        raise RolloutError(f"request {rid}: routed experts for {arr.shape[1]} layers; the model has "
                           f"{layout.num_layers}, {len(layout.moe_layers)} of them MoE")  # fmt: skip
    return torch.from_numpy(np.ascontiguousarray(arr)).to(torch.int16)


def engine_from_config(cfg, arch, info: TokenizerInfo, run_dir: Path, model_path) -> VLLMEngine:
    """The engine of ``rollout.engine: vllm`` (engines/registry.py): its servers start from ``model_path``."""
    return VLLMEngine.from_config(cfg, model_path, info, log_dir=Path(run_dir) / "vllm")


def attach_from_config(cfg, url: str) -> VLLMEngine:
    return VLLMEngine.from_config(cfg, None, server_urls=[url], start=False)
