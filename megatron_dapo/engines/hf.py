"""The embedded CPU rollout engine: a ``transformers`` causal LM with a compact batched KV-cache decode loop.

    engine = HFEngine(arch, TokenizerInfo(eos_token_ids=(2,), pad_token_id=0))
    engine.update_weights(bridge_buckets, version=3)        # HF-named full tensors, in process, no disk
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, seed=7), n=8)

Decoding: prompts are left-padded into one batch (attention mask + explicit position ids), prefilled once, then
decoded one token per step with a ``DynamicCache``; finished rows are dropped from the batch and the cache.
Sampling per row: logits / T, top-k, top-p, then inverse-CDF sampling with one ``torch.Generator`` per sample
seeded by ``sample_seed(seed, prompt_index, sample_index)``, so a fixed seed gives the same samples whatever the
batch size or batch composition (up to float rounding of the padded forward). Temperature 0 = argmax.
Returned logprobs: ``log_softmax(logits)`` of the sampled token at T=1, unmodified (see ``engine.py``).
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from megatron_dapo.engines.base import EngineBase
from megatron_dapo.models.arch import ArchConfig
from megatron_dapo.types import (
    Bucket,
    GenRequest,
    RolloutError,
    Sample,
    SamplingParams,
    TokenizerInfo,
    WeightSyncError,
    sample_seed,
)

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TIED_HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    try:
        return getattr(torch, dtype)
    except AttributeError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)} or a torch dtype name") from None


class HFEngine(EngineBase):
    """``RolloutEngine`` on a ``transformers`` model (CPU by default)."""

    def __init__(
        self,
        arch: ArchConfig,
        tokenizer_info: TokenizerInfo | None = None,
        dtype: torch.dtype | str = torch.float32,
        max_batch: int = 64,
        device: str | torch.device = "cpu",
        model: torch.nn.Module | None = None,
        seed: int | None = None,
        return_routes: bool = False,
    ):
        self.arch = arch
        self.dtype = as_dtype(dtype)
        self.device = torch.device(device)
        if max_batch < 1:
            raise ValueError(f"max_batch = {max_batch}: must be >= 1")
        self.max_batch = max_batch
        if model is None:
            from transformers import AutoModelForCausalLM

            from megatron_dapo.models.hf_config import transformers_config

            model = AutoModelForCausalLM.from_config(transformers_config(arch, str(self.dtype).split(".")[-1]))
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.tokenizer = tokenizer_info or _tokenizer_info_from_config(self.model.config)
        self.tied = bool(getattr(self.model.config, "tie_word_embeddings", arch.tie_embeddings))
        self._tensors = checkpoint_views(self.model.state_dict())  # views sharing storage with the parameters
        self._version = 0
        self._abort = threading.Event()
        self._rng = torch.Generator().manual_seed(seed if seed is not None else torch.seed() & 0x7FFFFFFF)
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.return_routes = return_routes
        self._routers = _moe_routers(self.model)
        if return_routes and not self._routers:
            raise RolloutError(f"routes asked for, but this {arch.family} model has no MoE router (mlp.gate)")

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        tokenizer_info: TokenizerInfo | None = None,
        dtype: torch.dtype | str = torch.float32,
        max_batch: int = 64,
        device: str | torch.device = "cpu",
        gguf_file: str | None = None,
        seed: int | None = None,
    ) -> HFEngine:
        """Load an HF checkpoint directory (safetensors + config.json), or a GGUF file in it (dequantized)."""
        from transformers import AutoModelForCausalLM

        from megatron_dapo.models.hf_config import arch_from_hf

        if gguf_file:
            model = load_gguf_model(Path(path) / gguf_file)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=as_dtype(dtype))
        arch = arch_from_hf(model.config.to_dict(), name=Path(path).name, source=str(path))
        return cls(arch, tokenizer_info, dtype=dtype, max_batch=max_batch, device=device, model=model, seed=seed)

    # ------------------------------------------------------------------------------------------------------------------
    # Weights

    @property
    def weight_version(self) -> int:
        return self._version

    def weight_names(self) -> list[str]:
        """The HF tensor names a full update must provide (the tied ``lm_head.weight`` is optional)."""
        return [n for n in self._tensors if not (self.tied and n == TIED_HEAD)]

    def update_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        """Load HF-named full tensors in place (strict: every weight, no unknown name, same shapes).

        Casts to the engine's dtype. On error the weights are partly updated and ``weight_version`` becomes -1."""
        self._version = -1
        seen: set[str] = set()
        tied_head = None
        with torch.no_grad():
            for bucket in buckets:
                for name, tensor in bucket:
                    if self.tied and name == TIED_HEAD:
                        tied_head = tensor  # the same storage as the embedding here: checked below, not loaded
                    else:
                        self._load_tensor(name, tensor)
                    seen.add(name)
        missing = [n for n in self.weight_names() if n not in seen]
        if missing:
            raise WeightSyncError(
                f"update_weights(version {version}): {len(missing)} tensor(s) missing from the buckets, "
                f"first: {missing[:5]}"
            )
        if tied_head is not None:
            embed = self._tensors[EMBED]
            if tuple(tied_head.shape) != tuple(embed.shape) or not torch.equal(tied_head.to(embed), embed):
                raise WeightSyncError(
                    f"tensor {TIED_HEAD!r}: embeddings are tied in this model but the sent lm_head differs from "
                    f"{EMBED!r}"
                )
        self._version = int(version)

    def _load_tensor(self, name: str, tensor: torch.Tensor) -> None:
        dst = self._tensors.get(name)
        if dst is None:
            raise WeightSyncError(
                f"tensor {name!r}: not a weight of this {self.arch.family} model ({len(self._tensors)} weights, "
                f"e.g. {next(iter(self._tensors))!r})"
            )
        if tuple(tensor.shape) != tuple(dst.shape):
            raise WeightSyncError(f"tensor {name!r}: shape {tuple(tensor.shape)}, the model has {tuple(dst.shape)}")
        dst.copy_(tensor)

    def state_tensor(self, name: str) -> torch.Tensor:
        """The engine's current tensor for an HF name (read back for verification)."""
        if name not in self._tensors:
            raise WeightSyncError(f"tensor {name!r}: not a weight of this model")
        return self._tensors[name]

    # ------------------------------------------------------------------------------------------------------------------
    # Lifecycle (nothing to release on CPU)

    def stream_lanes(self) -> tuple[int, int]:
        return 1, self.max_batch  # decodes one batch at a time, in lockstep

    def abort(self) -> None:
        self._abort.set()

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def health(self) -> bool:
        return True

    # ------------------------------------------------------------------------------------------------------------------
    # Generation

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, n: int = 1) -> list[Sample]:
        return [s for group in self.generate_stream(prompts, sampling, n) for s in group]

    def generate_stream(self, prompts: list[list[int]], sampling: SamplingParams, n: int = 1) -> Iterator[list[Sample]]:
        """Groups in prompt order, one micro-batch (``max_batch`` rows, whole groups) at a time; after ``abort()``
        the running micro-batch ends its samples with 'abort' and no further group is produced."""
        if n < 1:
            raise ValueError(f"n = {n}: must be >= 1")
        self._check_prompts(prompts)
        self._abort.clear()
        per_batch = max(1, self.max_batch // n)
        for start in range(0, len(prompts), per_batch):
            if self._abort.is_set():
                return
            indices = range(start, min(start + per_batch, len(prompts)))
            rows = [(p, j) for p in indices for j in range(n)]
            seeds = [self._seed(sampling.seed, p, j) for p, j in rows]
            samples = self._generate_rows([prompts[p] for p in indices], n, seeds, sampling)
            self._attach_routes([s for s in samples if s.response_ids])
            for s, (p, j) in zip(samples, rows):
                s.prompt_index, s.sample_index = p, j
            for k in range(len(indices)):
                group = samples[k * n : (k + 1) * n]
                if any(s.finish_reason == "abort" for s in group) and self._abort.is_set():
                    return
                yield group

    def _seed(self, seed: int | None, p: int, j: int) -> int:
        s = sample_seed(seed, p, j)
        return s if s is not None else int(torch.randint(0, 2**31 - 1, (), generator=self._rng))

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        vocab = self.model.config.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise RolloutError(f"prompt {i} is empty")
            if min(p) < 0 or max(p) >= vocab:
                raise RolloutError(f"prompt {i}: token ids must be in [0, {vocab}), got {min(p)}..{max(p)}")

    def _forward(self, ids, attn, pos, cache, last_only: bool) -> torch.Tensor:
        kw = {self._cache_kw: cache}
        out = self.model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
            **kw,
        )
        return out.logits[:, -1].float()

    @torch.no_grad()
    def routes_of(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Per sequence, [len - 1, MoE layers, top-k] int16: the experts this engine's model routes each token to
        (one batched forward with its weights, right-padded: causal attention keeps the pads out of the real tokens;
        the last token predicts nothing and is not routed)."""
        width = max(len(s) for s in sequences) - 1
        ids = torch.full((len(sequences), width), self.tokenizer.pad_token_id, dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, : len(s) - 1] = torch.tensor(s[:-1])
        captured: list[torch.Tensor] = []
        hooks = [r.register_forward_hook(lambda _m, _i, out: captured.append(out[2])) for r in self._routers]
        try:
            self.model(input_ids=ids.to(self.device), use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        every = torch.stack(captured, 1).to(device="cpu", dtype=torch.int16)  # [B·width, layers, k]
        every = every.reshape(len(sequences), width, *every.shape[1:])
        return [every[i, : len(s) - 1].clone() for i, s in enumerate(sequences)]

    def _attach_routes(self, samples: list[Sample]) -> None:
        if self.return_routes and samples:
            for s, r in zip(samples, self.routes_of([s.prompt_ids + s.response_ids for s in samples])):
                s.routes = r

    def generate_requests(self, requests: list[GenRequest], sampling: SamplingParams) -> Iterator[Sample]:
        """One sample per request (its own input, budget and seed; ``sampling.max_new_tokens`` is not used), each as
        soon as it finishes, ``prompt_index`` = the request's position. After ``abort()`` keep iterating: the rest
        come back with finish_reason 'abort' and the tokens they have (none for requests not started)."""
        self._check_prompts([r.input_ids for r in requests])
        self._abort.clear()
        for start in range(0, len(requests), self.max_batch):
            chunk = list(enumerate(requests))[start : start + self.max_batch]
            if self._abort.is_set():
                for i, r in chunk:
                    yield Sample(list(r.input_ids), [], [], "abort", prompt_index=i, weight_version=self._version)
                continue
            seeds = [r.seed if r.seed is not None else self._seed(None, 0, 0) for _, r in chunk]
            budgets = [r.max_new_tokens for _, r in chunk]
            offsets = [r.offset for _, r in chunk]
            for row, s in self._decode([r.input_ids for _, r in chunk], 1, seeds, sampling, budgets, offsets):
                s.prompt_index = chunk[row][0]
                self._attach_routes([s] if s.response_ids else [])
                yield s

    def _generate_rows(self, prompts: list[list[int]], n: int, seeds: list[int], sp: SamplingParams) -> list[Sample]:
        """``n`` samples of each prompt (rows grouped by prompt), in row order."""
        done = dict(self._decode(prompts, n, seeds, sp))
        return [done[i] for i in range(len(done))]

    @torch.no_grad()
    def _decode(
        self,
        prompts: list[list[int]],
        n: int,
        seeds: list[int],
        sp: SamplingParams,
        budgets: list[int] | None = None,
        offsets: list[int] | None = None,
    ) -> Iterator[tuple[int, Sample]]:
        """(row, sample) of ``n`` samples of each prompt (rows grouped by prompt), each as its row finishes. The prompts
        are prefilled once each and their KV cache repeated for the ``n`` rows of the group, so a group pays for its
        prompt once, not n times. ``budgets``: each row's token budget (default ``sp.max_new_tokens``); ``offsets``:
        the draws each row's generator skips first (one per token a resumed sample already has)."""
        from transformers import DynamicCache

        dev, B = self.device, len(prompts) * n
        budget = torch.tensor(budgets if budgets is not None else [sp.max_new_tokens] * B, dtype=torch.long)
        if budget.numel() != B or int(budget.min()) < 1:
            raise RolloutError(f"token budgets {budget.tolist()}: one per row, each >= 1")
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.tokenizer.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        ids, attn, pos = ids.to(dev), attn.to(dev), pos.to(dev)
        try:
            cache = DynamicCache(config=self.model.config)
        except TypeError:  # older transformers
            cache = DynamicCache()
        logits = self._forward(ids, attn, pos, cache, last_only=True)
        if n > 1:  # the group's rows share the prompt's keys and values
            cache.batch_repeat_interleave(n)
            logits, attn = logits.repeat_interleave(n, dim=0), attn.repeat_interleave(n, dim=0)
        prompts = [p for p in prompts for _ in range(n)]
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        if not sp.greedy:  # sample_tokens draws one uniform per token and row
            for g, skip in zip(gens, offsets or ()):
                for _ in range(skip):
                    torch.rand((), generator=g, dtype=torch.float64)
        stop = torch.tensor(sorted(set(self.tokenizer.eos_token_ids) | set(sp.stop_token_ids)), dtype=torch.long)
        steps = int(budget.max())
        tokens = torch.zeros((B, steps), dtype=torch.long)
        logps = torch.zeros((B, steps), dtype=torch.float64)

        def sample(i: int, length: int, finish: str) -> tuple[int, Sample]:
            ids_i = tokens[i, :length].tolist()
            return i, Sample(
                prompt_ids=list(prompts[i]),
                response_ids=ids_i,
                logprobs=logps[i, :length].tolist() if sp.logprobs else [],
                finish_reason=finish,  # type: ignore[arg-type]
                text=self.tokenizer.text(ids_i),
                weight_version=self._version,
            )

        active = torch.arange(B)  # rows still generating (indices into the batch)
        next_pos = attn.sum(-1)
        for step in range(steps):
            tok, lp = sample_tokens(logits, sp, [gens[i] for i in active.tolist()])
            tok, lp = tok.cpu(), lp.cpu()
            tokens[active, step], logps[active, step] = tok, lp.double()
            stopped = torch.isin(tok, stop)
            spent = budget[active] == step + 1
            for i, stp in zip(active[stopped | spent].tolist(), stopped[stopped | spent].tolist()):
                yield sample(i, step + 1, "stop" if stp else "length")
            keep = ~(stopped | spent)
            if not keep.any():
                break
            if self._abort.is_set():
                for i in active[keep].tolist():
                    yield sample(i, step + 1, "abort")
                break
            if not keep.all():
                sel = keep.nonzero().squeeze(1)
                cache.batch_select_indices(sel.to(dev))
                attn, next_pos = attn[sel.to(dev)], next_pos[sel.to(dev)]
                tok, active = tok[sel], active[sel]
            attn = torch.cat([attn, attn.new_ones((len(active), 1))], dim=1)
            logits = self._forward(tok[:, None].to(dev), attn, next_pos[:, None], cache, last_only=False)
            next_pos = next_pos + 1


def load_gguf_model(path: str | Path) -> torch.nn.Module:
    """A transformers model from a GGUF file, dequantized, without ``accelerate`` (which transformers'
    ``from_pretrained(..., gguf_file=...)`` requires and the CPU environment does not have)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = str(path)
    config = dict(load_gguf_checkpoint(path, return_tensors=False)["config"])
    config.pop("_model_name_or_path", None)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    missing = [k for k in result.missing_keys if not (k == TIED_HEAD and model.config.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise RolloutError(
            f"{path}: GGUF tensors do not fit the model: missing {missing}, unexpected {result.unexpected_keys}"
        )
    return model


def sample_tokens(
    logits: torch.Tensor, sp: SamplingParams, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens, logprob of each token under log_softmax(logits / T)), the sampling
    distribution before top-k / top-p (T = 1 when greedy): the convention of ``engine.py``."""
    logits = logits.float()
    if sp.greedy:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logits.argmax(dim=-1)
    else:
        scaled = logits / sp.temperature
        logp = torch.log_softmax(scaled, dim=-1)
        probs = torch.softmax(filter_logits(scaled, sp.top_k, sp.top_p), dim=-1)
        u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators]).to(probs.device)
        cdf = probs.double().cumsum(dim=-1)
        tok = (cdf < (u * cdf[:, -1]).unsqueeze(-1)).sum(dim=-1)
        last_valid = probs.shape[-1] - 1 - (probs > 0).flip(-1).to(torch.int8).argmax(dim=-1)
        tok = torch.minimum(tok, last_valid)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def filter_logits(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and outside the smallest set with probability >= top_p."""
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        p = torch.softmax(sorted_x, dim=-1)
        drop_sorted = (p.cumsum(dim=-1) - p) > top_p  # mass before this token already covers top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def _tokenizer_info_from_config(config) -> TokenizerInfo:
    eos = getattr(config, "eos_token_id", None)
    pad = getattr(config, "pad_token_id", None)
    eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    pad_id = pad if pad is not None else (eos_ids[0] if eos_ids else 0)
    return TokenizerInfo(eos_token_ids=eos_ids, pad_token_id=int(pad_id))


def engine_from_config(cfg, arch: ArchConfig, info: TokenizerInfo, run_dir, model_path) -> HFEngine:
    """The in-process engine of ``rollout.engine: hf`` (engines/registry.py); it starts from the actor's weights."""
    dtype = "float32" if cfg.model.dtype == "fp32" else "bfloat16"
    from megatron_dapo.models.arch import routes_wanted

    return HFEngine(
        arch,
        info,
        dtype=dtype,
        max_batch=cfg.rollout.hf.max_batch,
        seed=cfg.train.seed,
        return_routes=routes_wanted(cfg.rollout.routing_replay, arch),
    )


def _moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE routers of a transformers model, in layer order: ``model.layers.<i>.mlp.gate`` modules that pick a top-k
    (transformers' ``*TopKRouter`` of the MoE families: forward returns (logits, scores, indices))."""
    found = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if len(parts) >= 3 and parts[-2:] == ["mlp", "gate"] and parts[-3].isdigit() and hasattr(module, "top_k"):
            found.append((int(parts[-3]), module))
    return [m for _, m in sorted(found, key=lambda x: x[0])]


def checkpoint_views(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's tensors under their checkpoint (safetensors) names, as views of its parameters.

    transformers 5 holds a mixture of experts fused in memory and names each expert only on disk: ``mlp.experts.
    gate_up_proj`` [E, 2F, H] is ``[gate_e; up_e]`` per expert and ``mlp.experts.down_proj`` [E, H, F]
    (transformers/conversion_mapping.py: ``MergeModulelist(dim=0), Concatenate(dim=1)`` from
    ``mlp.experts.*.gate_proj.weight`` / ``up_proj.weight``). Weight syncs send checkpoint names, so each expert's
    tensor here is a slice of the fused parameter (copying into it updates the model)."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj") and t.dim() == 3:
            prefix, half = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :half]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, half:]
        elif name.endswith("mlp.experts.down_proj") and t.dim() == 3:
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out
