"""The SGLang rollout engine: SGLang servers driven over HTTP (sglang itself is imported by nothing here).

    servers = [SGLangServer(hf_dir, port=30000, tp_size=8, mem_fraction=0.6, memory_saver=True)]    # GPU
    servers = [SGLangServer(hf_dir, device="cpu", pythonpath=[stand_ins], mem_fraction=0.05)]        # CPU
    engine = SGLangEngine(servers, tokenizer_info=tok, resync=lambda dead: weight_sync.sync(export(), v, dead))
    for group in engine.generate_stream(prompts, sampling, n=16): ...
    engine.shutdown()                                        # stops only the processes it started

* ``SGLangServer`` (``sglang_server.py``): one ``python -m sglang.launch_server`` subprocess (own process group, log
  file) or an attached URL. ``wait_healthy`` polls /health and fails with the log tail; ``stop`` signals only its own
  process group.
* ``SGLangEngine``: one HTTP request per sample (rid, ``sampling_seed``; stdlib ``urllib``), each worker with its own
  pool of ``per_server_concurrency`` threads (what it runs at once, capped by ``max_concurrency``). /generate goes to
  ``router_url`` (sglang-router) when given, else, with ``fanout="prompt"`` (``rollout.fanout``, the default), every sample of a prompt to one worker (its radix
  cache prefills the prompt once), the worker with the fewest requests assigned and unfinished when the prompt is
  submitted, so every engine's batch stays full; ``fanout="request"`` is round-robin per request
  (``bench/fanout.py`` measures both and sglang-router on real CPU servers). Weight-sync, memory and abort calls
  always go to the workers (the router answers 404 for weight sync and abort). A request that fails because a server died is re-issued after the engine, in the
  caller's thread, restarted the dead server (or waited for an attached one) and called ``resync(dead_servers)``
  to bring it to the current weight version; ``metrics`` counts restarts and re-issued requests. More than
  ``max_restarts_per_step`` restarts between two ``new_step()`` calls raise ``ServerRestartLimit`` naming the
  server's node, URL and log file.
* ``PLATFORMS`` (``sglang_server.py``): what differs between SGLang on GPUs and on a CPU, as values (server flags
  and environment, where the tensor transport's tensors live, the distributed transport's backend). Nothing else
  branches on the device.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_dapo.engines.sglang import types as T
from megatron_dapo.engines.sglang.aborts import Aborts
from megatron_dapo.engines.sglang.capacity import (
    fit_open_files,
    open_file_budget,
    per_server_concurrency,
    server_capacity,
)
from megatron_dapo.engines.sglang.routes import RouteLayout
from megatron_dapo.engines.sglang.server import (
    DTYPE_NAMES,
    ServerRequestError,
    ServerUnavailable,
    SGLangServer,
    http_call,
    server_dtype,
    servers_from_config,
)
from megatron_dapo.types import Bucket, GenRequest, RolloutError, Sample, SamplingParams, TokenizerInfo, sample_seed

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------------------------------
# The engine


class ServerRestartLimit(RolloutError):
    """A server died more often in one step than ``rollout.max_restarts_per_step`` allows."""


@dataclass
class _Failed:
    """A request that got no answer (server down): the caller's thread recovers and re-issues it."""

    key: tuple[int, int]
    error: Exception


class SGLangEngine(Aborts):
    """``RolloutEngine`` over SGLang servers (HTTP)."""

    lora_name: str | None = None  # LoRA adapter-only sync: the adapter requests run with (adapter_sync.py)

    def __init__(
        self,
        servers: Sequence[SGLangServer],
        *,
        router_url: str | None = None,
        tokenizer_info: TokenizerInfo | None = None,
        dtype: str = "bfloat16",
        max_concurrency: int = 512,
        request_timeout: float = 3600.0,
        server_timeout: float = 600.0,
        max_retries: int = 3,
        resync: Callable[[list[SGLangServer]], None] | None = None,
        max_restarts_per_step: int | None = None,
        fanout: str = "prompt",
        start: bool = True,
        routes: RouteLayout | None = None,
    ):
        if fanout not in ("prompt", "request"):
            raise ValueError(f"rollout.fanout = {fanout!r}: expected 'prompt' or 'request'")
        if not servers:
            raise ValueError("SGLangEngine needs at least one server")
        self.servers = list(servers)
        if len({(s.platform, s.tp_size) for s in self.servers}) != 1:
            raise ValueError(f"SGLangEngine: servers differ in device or TP size: {self.servers}")
        self.platform, self.tp_size = self.servers[0].platform, self.servers[0].tp_size
        self.router_url = router_url.rstrip("/") if router_url else None
        self.tokenizer = tokenizer_info
        self.dtype = DTYPE_NAMES.get(dtype, dtype)
        self.request_timeout, self.server_timeout, self.max_retries = request_timeout, server_timeout, max_retries
        self.resync = resync
        self.max_restarts_per_step = max_restarts_per_step  # None: no limit
        self.step_restarts = 0
        self.metrics = {"requests": 0, "reissued": 0, "restarts": 0, "aborted": 0}
        self.max_concurrency = max_concurrency  # the cap on each worker's requests in flight
        self.concurrency: dict[str, int] = {}  # url -> requests in flight at most (per_server_concurrency)
        self._pools: dict[str, cf.ThreadPoolExecutor] = {}  # url (a worker's, or the router's) -> its requests' threads
        self._on_shutdown: list[Callable[[], None]] = []  # run before the servers stop (weight-sync groups close)
        self._lock = threading.Lock()
        self._rr = 0
        self.fanout = fanout
        self._assigned: dict[str, set[str]] = {s.url: set() for s in self.servers}  # url -> rids sent, unfinished
        self._version = 0
        self._inflight: dict[str, tuple[str, int]] = {}  # rid -> (URL it was sent to, its abort generation)
        self._abort_gen = 0  # bumped by abort(); requests of an older generation are dropped
        self._abort_gate = threading.Lock()  # held while abort_all calls are on their way: no request starts
        self._closed = threading.Event()  # set by shutdown: background re-aborts stop
        self._released: dict[str, set[str]] = {s.url: set() for s in self.servers}  # url -> tags released (sleep)
        self.routes = routes  # MoE routing replay: ask every request for its routed experts
        if start:
            self.start()

    @classmethod
    def from_config(
        cls,
        cfg,
        model_path: str | Path | None,
        tokenizer_info: TokenizerInfo | None = None,
        log_dir=None,
        server_urls: Sequence[str] | None = None,
        start: bool = True,
    ):
        """Attach to ``server_urls`` (default ``rollout.server_urls``) or start one local server with the rollout
        section's settings; ``start=False``: neither start nor wait for them."""
        r = cfg.rollout
        servers = servers_from_config(cfg, model_path, log_dir, server_urls)
        return cls(
            servers,
            routes=RouteLayout.of(cfg),
            tokenizer_info=tokenizer_info,
            dtype=server_dtype(cfg),
            max_concurrency=r.max_concurrency,
            server_timeout=r.server_timeout_s,
            max_restarts_per_step=r.max_restarts_per_step,
            fanout=r.fanout,
            start=start,
        )

    # ------------------------------------------------------------------------------------------------------------------
    # Lifecycle

    def start(self) -> None:
        for s in self.servers:
            if not s.attached:
                s.start()
        for s in self.servers:
            s.wait_healthy(self.server_timeout)
        self._ensure_pools()

    def _ensure_pools(self) -> None:
        """A pool per worker, sized from what it reports it can run (once per worker) within the open-file limit; the
        router's: their sum."""
        new = [s for s in self.servers if s.url not in self.concurrency]
        with cf.ThreadPoolExecutor(max_workers=max(1, len(new))) as ex:
            caps = list(ex.map(lambda s: server_capacity(s.url, http_call, self.server_timeout), new))
        wanted = {s.url: per_server_concurrency(self.max_concurrency, cap) for s, cap in zip(new, caps)}
        fitted = fit_open_files({**self.concurrency, **wanted}, open_file_budget())
        for s, cap in zip(new, caps):
            self.concurrency[s.url] = fitted[s.url]
            self._pools[s.url] = cf.ThreadPoolExecutor(self.concurrency[s.url], thread_name_prefix="sglang-req")
            log.info("%s: %s requests in flight (reports capacity %s)", s.url, self.concurrency[s.url], cap)
        if self.router_url and self.router_url not in self._pools:
            total = sum(self.concurrency[s.url] for s in self.servers)
            self._pools[self.router_url] = cf.ThreadPoolExecutor(total, thread_name_prefix="sglang-req")

    def shutdown(self, stop_servers: bool = True) -> None:
        """Abort what is in flight and, unless ``stop_servers`` is False, stop the servers this engine started."""
        self.abort()
        self._closed.set()  # the re-abort thread stops
        for close in reversed(self._on_shutdown):
            close()
        self._on_shutdown.clear()
        if stop_servers:
            for s in self.servers:
                s.stop()
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    def on_shutdown(self, close: Callable[[], None]) -> None:
        """Run ``close`` at ``shutdown``, while the servers still answer (a transport's process group)."""
        self._on_shutdown.append(close)

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def health(self) -> bool:
        return all(s.healthy() for s in self.servers)

    @property
    def worker_urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def weight_version(self) -> int:
        return self._version

    def set_weight_version(self, version: int) -> None:
        self._version = int(version)

    def new_step(self) -> None:
        """A new training step: the restart budget (``max_restarts_per_step``) starts again."""
        self.step_restarts = 0

    def call_workers(
        self, path: str, body: dict | None, servers: Sequence[SGLangServer] | None = None, timeout: float | None = None
    ) -> list:
        """The same call on every worker (in parallel); answers in worker order. Errors name the worker."""
        servers = list(servers) if servers is not None else self.servers
        timeout = timeout or self.server_timeout
        with cf.ThreadPoolExecutor(max_workers=max(1, len(servers))) as ex:
            futures = [ex.submit(http_call, s.url, path, body, timeout) for s in servers]
            return [f.result() for f in futures]

    def sleep(self, tags: list[str] | None = None, idle_timeout_s: float = 120.0) -> None:
        """Release GPU memory (servers need --enable-memory-saver, i.e. rollout.colocate); no tags = all it holds.

        SGLang's handler asserts ``is_fully_idle`` (``weight_updater.py`` ``release_memory_occupation``: no running
        batch, no chunked prefill, no last batch, an empty result queue); a failed assert in the scheduler kills the
        server (SIGQUIT). /v1/loads counts only running and waiting requests: it reads 0/0 during a chunked prefill
        (``load_inquirer.py`` ``get_loads``). So, as slime does, a /flush_cache that succeeds (it runs only when the
        scheduler is fully idle, and clears ``last_batch``) comes first, retried until it answers 200."""
        want = list(tags or T.MEMORY_TAGS)
        if all(t in self._released[x.url] for x in self.servers for t in want):
            return
        self.wait_idle(idle_timeout_s)
        self.flush_when_idle(idle_timeout_s)
        self._memory_call("/release_memory_occupation", want, held=True)

    def flush_when_idle(self, timeout_s: float = 120.0, poll_s: float = 0.2) -> None:
        """/flush_cache on every worker until each answers 200 (the scheduler flushes only when fully idle; its
        ``?timeout=`` lets it wait for that itself); RolloutError naming the workers still refusing after
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s

        def flush(s: SGLangServer) -> None:
            while True:
                wait = max(0.0, min(10.0, deadline - time.monotonic()))
                try:
                    http_call(s.url, f"/flush_cache?timeout={wait:.1f}", {}, timeout=wait + self.server_timeout)
                    return
                except ServerRequestError as e:  # 400: not idle yet (or another flush in progress)
                    if time.monotonic() >= deadline:
                        raise RolloutError(
                            f"{s.url}: /flush_cache still refused after {timeout_s:.0f} s ({e}): the scheduler is "
                            "not idle (a chunked prefill or a batch's result pending), and releasing its memory now "
                            "would fail SGLang's idle assertion and kill the server"
                        ) from None
                    time.sleep(poll_s)

        with cf.ThreadPoolExecutor(max_workers=len(self.servers)) as ex:
            for f in [ex.submit(flush, s) for s in self.servers]:
                f.result()

    def wait_idle(self, timeout_s: float = 120.0, poll_s: float = 0.1) -> None:
        """Until no aborted request of this engine is unanswered (each re-aborted: it may have reached its worker
        after the abort, and a worker's load is 0 until it arrives) and every worker's /v1/loads shows no running
        and no waiting request; RolloutError naming the busy ones."""
        deadline = time.monotonic() + timeout_s
        while True:
            stale = self._reabort_stale()
            answers = self.call_workers("/v1/loads?include=core", None)
            busy = [
                f"{s.url}: {load.get('num_running_reqs')} running, {load.get('num_waiting_reqs')} waiting"
                for s, ans in zip(self.servers, answers)
                for load in (ans or {}).get("loads", [])
                if load.get("num_running_reqs") or load.get("num_waiting_reqs")
            ]
            busy += [f"{stale} aborted requests not answered yet"] if stale else []
            if not busy:
                return
            if time.monotonic() > deadline:
                raise RolloutError(f"servers still busy after {timeout_s:.0f} s (release needs them idle): {busy}")
            time.sleep(poll_s)

    def wake(self, tags: list[str] | None = None) -> None:
        """Resume what ``sleep`` released (no tags: all of it), in the order given; a tag not released is skipped
        (SGLang's resume handler removes each tag from its set: an unknown one raises in the scheduler)."""
        self._memory_call("/resume_memory_occupation", list(tags or T.MEMORY_TAGS), held=False)

    def _memory_call(self, path: str, tags: list[str], held: bool) -> None:
        """Release (``held``: the tags a worker still holds) or resume (those it released) on every worker, each
        worker asked only for its own tags (a restarted server holds everything again)."""
        by_tags: dict[tuple[str, ...], list[SGLangServer]] = {}
        for x in self.servers:
            mine = tuple(t for t in tags if (t in self._released[x.url]) != held)
            if mine:
                by_tags.setdefault(mine, []).append(x)
        for mine, servers in by_tags.items():
            body = (T.ReleaseMemoryRequest if held else T.ResumeMemoryRequest)(tags=list(mine)).to_json()
            self.call_workers(path, body, servers)
            for x in servers:
                (self._released[x.url].update if held else self._released[x.url].difference_update)(mine)

    def released(self, url: str | None = None) -> list[str]:
        """The memory tags released (on ``url``, default the first worker) and not yet resumed, in SGLang's order."""
        mine = self._released[url or self.servers[0].url]
        return [t for t in T.MEMORY_TAGS if t in mine]

    def update_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        """Protocol method: a plain (unverified) update through safetensors on disk. The trainer uses
        ``driver.make_weight_sync`` for the configured transport with verification."""
        from megatron_dapo.engines.sglang.sync import DiskSync

        DiskSync(self, verify="off").sync(buckets, version)

    # ------------------------------------------------------------------------------------------------------------------
    # Generation

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, n: int = 1) -> list[Sample]:
        groups = sorted(self.generate_stream(prompts, sampling, n), key=lambda g: g[0].prompt_index)
        return [s for g in groups for s in g]

    def generate_stream(self, prompts: list[list[int]], sampling: SamplingParams, n: int = 1) -> Iterator[list[Sample]]:
        if n < 1:
            raise ValueError(f"n = {n}: must be >= 1")
        for i, p in enumerate(prompts):
            if not p:
                raise RolloutError(f"prompt {i} is empty")
        self.wake()  # what the phases left released until now (KV cache, CUDA graphs: resumed after the sync)
        self._ensure_pools()
        gen = self._abort_gen
        tag = uuid.uuid4().hex[:12]
        attempts: dict[tuple[int, int], int] = {}
        pending: dict[cf.Future, tuple[str, str]] = {}  # -> (rid, url)
        done: dict[int, dict[int, Sample]] = {}
        routes: dict[int, str] = {}  # prompt -> the worker its samples go to (fanout = prompt)

        def submit(key: tuple[int, int]) -> None:
            attempts[key] = attempts.get(key, 0) + 1
            p, j = key
            rid = f"{tag}-{p}-{j}-{attempts[key]}"
            req = self._request(prompts[p], sampling, sample_seed(sampling.seed, p, j), rid)
            url = self._pick_url(routes, p, rid, retry=attempts[key] > 1)
            pending[self._pools[url].submit(self._run, key, req, gen, url)] = (rid, url)

        for p in range(len(prompts)):
            for j in range(n):
                submit((p, j))
        try:
            while pending:
                finished, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                for fut in finished:
                    pending.pop(fut)
                    if fut.cancelled():
                        continue
                    result = fut.result()
                    if self._abort_gen != gen:
                        continue
                    if isinstance(result, _Failed):
                        if attempts[result.key] > self.max_retries:
                            raise RolloutError(
                                f"prompt {result.key[0]} sample {result.key[1]}: no answer after "
                                f"{attempts[result.key]} attempts: {result.error}"
                            )
                        self._recover()
                        self.metrics["reissued"] += 1
                        submit(result.key)
                        continue
                    p, j = result.prompt_index, result.sample_index
                    done.setdefault(p, {})[j] = result
                    if len(done[p]) == n:
                        group = done.pop(p)
                        yield [group[k] for k in range(n)]
                if self._abort_gen != gen:
                    return
        finally:
            for fut, (rid, url) in pending.items():
                if fut.cancel():  # never ran: no longer assigned to its worker
                    self._unassign(rid, url)

    def generate_requests(self, requests: list[GenRequest], sampling: SamplingParams) -> Iterator[Sample]:
        """One sample per request (partial rollout: its own input, budget and seed), each as it finishes,
        ``prompt_index`` = the request's position. After ``abort()`` keep iterating: the rest come back with
        finish_reason 'abort' and what SGLang generated until the abort (an aborted /generate answers 200 with its
        output_ids and logprobs so far: tests/sglang/test_partial.py), none for requests not yet sent."""
        for i, r in enumerate(requests):
            if not r.input_ids or r.max_new_tokens < 1:
                raise RolloutError(f"request {i}: empty input or a budget of {r.max_new_tokens} tokens")
        self.wake()  # as generate_stream
        self._ensure_pools()
        gen, tag = self._abort_gen, uuid.uuid4().hex[:12]
        attempts: dict[int, int] = {}
        pending: dict[cf.Future, int] = {}
        routes: dict[int, str] = {}

        def submit(i: int) -> None:
            attempts[i] = attempts.get(i, 0) + 1
            rid = f"{tag}-{i}-{attempts[i]}"
            r = requests[i]  # a resumed sample: a fresh stream of draws (SGLang cannot skip into one)
            seed = sample_seed(r.seed, r.offset, 1) if r.offset else r.seed
            req = self._request(r.input_ids, sampling, seed, rid, max_new_tokens=r.max_new_tokens)
            url = self._pick_url(routes, requests[i].route, rid, retry=attempts[i] > 1)
            pending[self._pools[url].submit(self._run, (i, 0), req, gen, url)] = i

        for i in range(len(requests)):
            submit(i)
        while pending:
            finished, _ = cf.wait(pending, timeout=1.0, return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                i = pending.pop(fut)
                result = fut.result()
                if isinstance(result, _Failed):
                    if self._abort_gen != gen:  # aborted anyway: what it had is lost with its server
                        result = Sample(list(requests[i].input_ids), [], [], "abort", prompt_index=i)
                    elif attempts[i] > self.max_retries:
                        raise RolloutError(f"request {i}: no answer after {attempts[i]} attempts: {result.error}")
                    else:
                        self._recover()
                        self.metrics["reissued"] += 1
                        submit(i)
                        continue
                yield result

    def _request(
        self, prompt: list[int], sp: SamplingParams, seed: int | None, rid: str, max_new_tokens: int | None = None
    ) -> T.GenerateRequest:
        stop = sorted(set(sp.stop_token_ids) | set(self.tokenizer.eos_token_ids if self.tokenizer else ()))
        return T.GenerateRequest(
            input_ids=list(prompt),
            sampling_params=T.SGLangSamplingParams(
                max_new_tokens=max_new_tokens or sp.max_new_tokens,
                temperature=sp.temperature,
                top_p=sp.top_p,
                top_k=sp.top_k if sp.top_k > 0 else -1,
                stop_token_ids=stop or None,
                sampling_seed=seed,
            ),
            return_logprob=sp.logprobs,
            rid=rid,
            return_routed_experts=True if self.routes else None,
            lora_path=self.lora_name,
        )

    def _pick_url(self, routes: dict[int, str], prompt: int, rid: str, retry: bool = False) -> str:
        """The URL request ``rid`` of ``prompt`` goes to (see the module docstring); counted as assigned to it."""
        if self.router_url:
            return self.router_url
        with self._lock:
            if self.fanout == "request":
                self._rr = (self._rr + 1) % len(self.servers)
                url = self.servers[self._rr].url
            elif prompt in routes and not retry:
                url = routes[prompt]
            else:  # least loaded; ties rotate, so a batch submitted at once alternates between equal workers
                self._rr = (self._rr + 1) % len(self.servers)
                order = self.servers[self._rr :] + self.servers[: self._rr]
                url = routes[prompt] = min(order, key=lambda s: len(self._assigned[s.url])).url
            self._assigned.setdefault(url, set()).add(rid)
            return url

    def _unassign(self, rid: str, url: str) -> None:
        with self._lock:
            self._assigned.get(url, set()).discard(rid)

    def _run(self, key: tuple[int, int], req: T.GenerateRequest, gen: int, url: str) -> Sample | _Failed:
        rid = str(req.rid)
        # one look at the abort generation: a request the pool starts after abort() is never sent; none is sent while
        # an abort_all is on its way (it would end the request too)
        with self._abort_gate, self._lock:
            cancelled = self._abort_gen != gen
            if not cancelled:
                self._inflight[rid] = (url, gen)
                self.metrics["requests"] += 1  # requests sent
        try:
            if cancelled:
                raise cf.CancelledError
            answer = http_call(url, "/generate", req.to_json(), timeout=self.request_timeout)
            resp = T.GenerateResponse.from_json(answer)
        except ServerUnavailable as e:
            return _Failed(key, e)
        except cf.CancelledError:
            resp = T.GenerateResponse(meta_info=T.MetaInfo(id=rid, finish_reason=T.FinishReason("abort")))
        finally:
            with self._lock:
                self._inflight.pop(rid, None)
                self._assigned.get(url, set()).discard(rid)
        return self._sample(key, req, resp)

    def _sample(self, key: tuple[int, int], req: T.GenerateRequest, resp: T.GenerateResponse) -> Sample:
        ids, logprobs = resp.token_ids, resp.logprobs
        if req.return_logprob and len(logprobs) != len(ids):
            raise RolloutError(f"request {req.rid}: {len(ids)} output tokens but {len(logprobs)} logprobs")
        finish = resp.finish_type
        if finish == "abort":
            with self._lock:
                self.metrics["aborted"] += 1
        version = resp.meta_info.weight_version
        routes = None
        if self.routes and ids:
            routes = self.routes.decode(resp.meta_info.routed_experts, len(req.input_ids) + len(ids), str(req.rid))
        return Sample(
            prompt_ids=list(req.input_ids),
            response_ids=ids,
            logprobs=logprobs,
            finish_reason=finish,  # type: ignore[arg-type]
            text=resp.text if resp.text or self.tokenizer is None else self.tokenizer.text(ids),
            prompt_index=key[0],
            sample_index=key[1],
            weight_version=int(version) if str(version).lstrip("-").isdigit() else self._version,
            meta={"rid": req.rid},
            routes=routes,
        )

    def stream_lanes(self) -> tuple[int, int]:
        """One request per call, as many at once as the servers run (their thread pools)."""
        self._ensure_pools()
        return max(1, sum(self.concurrency.values())), 1

    def _recover(self) -> None:
        """Restart (or wait for) every unhealthy server, then resync it to the current weight version."""
        dead = [s for s in self.servers if not s.healthy()]
        if not dead:
            return
        if self._version != 0 and self.resync is None:
            raise RolloutError(
                f"{dead} died; restarted they would serve the initial weights but the engine is at weight version "
                f"{self._version} and no resync callback was given: refusing to sample from stale weights"
            )
        for s in dead:
            limit = self.max_restarts_per_step
            if limit is not None and self.step_restarts >= limit:
                where = f"log {s.log_path}" if s.log_path else "attached: its log is where it was started"
                raise ServerRestartLimit(
                    f"rollout server {s.url} on node {s.node} died with {self.step_restarts} restarts spent this step "
                    f"(rollout.max_restarts_per_step = {limit}): stopping; {where}"
                )
            self.step_restarts += 1
            self.metrics["restarts"] += 1
            log.warning("%s is down; %s", s, "waiting for it" if s.attached else "restarting it")
            if s.attached:
                s.wait_healthy(self.server_timeout)
            else:
                s.restart(self.server_timeout)
            self._released[s.url] = set()  # a new server process holds all its memory
        if self._version != 0:
            self.resync(dead)


def engine_from_config(cfg, arch, info: TokenizerInfo, run_dir: Path, model_path) -> SGLangEngine:
    """The engine of ``rollout.engine: sglang`` (engines/registry.py): its servers start from ``model_path``."""
    return SGLangEngine.from_config(cfg, model_path, info, log_dir=Path(run_dir) / "sglang")


def attach_from_config(cfg, url: str) -> SGLangEngine:
    """An engine attached to the running server at ``url`` that never generates: a per-node sync's transport
    (engines/registry.py ``attach_factory``)."""
    return SGLangEngine.from_config(cfg, None, server_urls=[url], start=False)
