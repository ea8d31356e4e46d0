"""STAND-IN for an SGLang server (SGLang cannot run on CPU): a real HTTP process for testing the client side.

Accepts ``sglang.launch_server``'s arguments (--model-path, --host, --port, --tp-size, --mem-fraction-static,
--dtype, --enable-memory-saver) and implements, with SGLang 0.5's request/response shapes: /health, /generate
(deterministic pseudo-random tokens, honouring max_new_tokens, stop_token_ids, abort), /abort_request,
/update_weights_from_disk (safetensors via numpy), /get_weights_by_name (first rows), /flush_cache,
/release_memory_occupation, /resume_memory_occupation, plus /standin_stats for the tests. Every request body is
parsed STRICTLY with megatron_dapo.rollout.sglang_types (an unknown field answers 400).

Fault injection (stand-in only): --startup-delay S, --never-ready, --token-delay S, --slow-first-token K
(prompts starting with token K take 1 s per token), --die-after-generates N --die-marker PATH (exit abruptly
on the N+1-th /generate, once: the marker file records that it happened), --corrupt-on-load NAME, --router
(acts as sglang-router: answers 404 for weight-sync endpoints).

No model runs here: tokens are a function of (input_ids, seed, weight version) only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from megatron_dapo.rollout import sglang_types as T

WEIGHT_SYNC = (
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/init_weights_update_group",
    "/get_weights_by_name",
)


class State:
    def __init__(self, args):
        self.args = args
        self.ready_at = time.monotonic() + args.startup_delay
        self.lock = threading.Lock()
        self.weights: dict = {}
        self.version = "default"
        self.aborted: set[str] = set()
        self.stats = {"generate": 0, "abort_rids": [], "released": [], "resumed": [], "updates": 0, "flushes": 0}
        if args.model_path and Path(args.model_path).is_dir():
            self.load(args.model_path)

    def load(self, path: str) -> None:
        import torch  # lazily: only a weight load pays for it (bf16 files need torch)
        from safetensors.torch import load_file

        dtype = getattr(torch, self.args.dtype, None)  # --dtype float32/bfloat16: stored like SGLang would
        weights = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            for name, t in load_file(str(f)).items():
                weights[name] = (t.to(dtype) if dtype is not None else t).float().numpy()
        if self.args.corrupt_on_load in weights:
            weights[self.args.corrupt_on_load] = weights[self.args.corrupt_on_load] + 1e-3
        self.weights = weights


def make_handler(state: State):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            print(f"[standin] {self.address_string()} {fmt % args}", flush=True)

        def reply(self, code: int, body=None) -> None:
            data = b"" if body is None and code == 200 else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            path = self.path.split("?")[0]
            if path == "/health":
                ok = not state.args.never_ready and time.monotonic() >= state.ready_at
                return self.reply(200 if ok else 503, None if ok else {"error": "loading"})
            if path == "/standin_stats":
                with state.lock:
                    return self.reply(200, {**state.stats, "version": state.version, "pid": os.getpid()})
            if path in ("/flush_cache", "/release_memory_occupation", "/resume_memory_occupation"):
                return self.handle_post(path, {})
            return self.reply(404, {"error": f"no route {path}"})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else {}
            except ValueError:
                return self.reply(400, {"error": "body is not JSON"})
            return self.handle_post(self.path.split("?")[0], body)

        def handle_post(self, path: str, body: dict):
            if state.args.router and path in WEIGHT_SYNC:
                return self.reply(404, {"error": "router: not found"})
            if path == "/flush_cache":
                state.stats["flushes"] += 1
                return self.reply(200, None)
            schema = T.ENDPOINTS.get(path)
            if schema is None:
                return self.reply(404, {"error": f"no route {path}"})
            try:
                req = schema.from_json(body)
            except T.SchemaError as e:
                return self.reply(400, {"error": str(e)})
            return getattr(self, "h_" + path.strip("/"))(req)

        def h_generate(self, req: T.GenerateRequest):
            with state.lock:
                state.stats["generate"] += 1
                count = state.stats["generate"]
            a = state.args
            if a.die_after_generates is not None and count > a.die_after_generates and not Path(a.die_marker).exists():
                Path(a.die_marker).write_text(str(os.getpid()))
                print("[standin] dying abruptly (fault injection)", flush=True)
                os._exit(3)
            sp = req.sampling_params
            rid = req.rid or f"auto-{count}"
            rng = random.Random(f"{req.input_ids}|{sp.sampling_seed}|{state.version}|{sp.temperature}")
            delay = 1.0 if a.slow_first_token is not None and req.input_ids[0] == a.slow_first_token else a.token_delay
            stops = set(sp.stop_token_ids or [])
            ids, logprobs, finish = [], [], None
            for _ in range(sp.max_new_tokens):
                if delay:
                    time.sleep(delay)
                if rid in state.aborted:
                    finish = T.FinishReason("abort", message="aborted by /abort_request")
                    break
                tok = rng.randrange(a.vocab)
                ids.append(tok)
                logprobs.append((-3.0 * rng.random(), tok, None))
                if tok in stops:
                    finish = T.FinishReason("stop", matched=tok)
                    break
            finish = finish or T.FinishReason("length", length=len(ids))
            meta = T.MetaInfo(
                id=rid,
                prompt_tokens=len(req.input_ids),
                completion_tokens=len(ids),
                finish_reason=finish,
                output_token_logprobs=logprobs if req.return_logprob else None,
                weight_version=state.version,
            )
            text = " ".join(f"t{t}" for t in ids)
            self.reply(200, T.GenerateResponse(text=text, output_ids=ids, meta_info=meta).to_json())

        def h_abort_request(self, req: T.AbortRequest):
            with state.lock:
                state.aborted.add(req.rid)
                state.stats["abort_rids"].append(req.rid)
            self.reply(200, None)

        def h_update_weights_from_disk(self, req: T.UpdateWeightsFromDiskRequest):
            try:
                state.load(req.model_path)
            except Exception as e:  # noqa: BLE001 - reported to the client like SGLang does
                return self.reply(200, T.SuccessResponse(False, f"failed to load {req.model_path}: {e}").to_json())
            with state.lock:
                state.version = req.weight_version or state.version
                state.stats["updates"] += 1
            self.reply(200, T.SuccessResponse(True, "Succeeded to update model weights.", 0).to_json())

        def h_get_weights_by_name(self, req: T.GetWeightsByNameRequest):
            w = state.weights.get(req.name)
            self.reply(200, None if w is None else w[: req.truncate_size].astype("float32").tolist())

        def h_release_memory_occupation(self, req):
            state.stats["released"].append(req.tags)
            self.reply(200, None)

        def h_resume_memory_occupation(self, req):
            state.stats["resumed"].append(req.tags)
            self.reply(200, None)

    return Handler


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="stand-in for sglang.launch_server (SGLang cannot run on CPU)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=0.9)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--startup-delay", type=float, default=0.0)
    p.add_argument("--never-ready", action="store_true")
    p.add_argument("--token-delay", type=float, default=0.0)
    p.add_argument("--slow-first-token", type=int, default=None)
    p.add_argument("--die-after-generates", type=int, default=None)
    p.add_argument("--die-marker", default="")
    p.add_argument("--corrupt-on-load", default=None)
    p.add_argument("--router", action="store_true")
    args = p.parse_args(argv)
    print(f"[standin] stand-in SGLang server (SGLang cannot run on CPU): {vars(args)}", flush=True)
    if args.never_ready:
        print("[standin] pretending to load weights forever", flush=True)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(State(args)))
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
