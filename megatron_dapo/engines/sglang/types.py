"""Typed requests/responses for the SGLang 0.5.x HTTP endpoints used in RL (sglang 0.5.23: python/sglang/srt/managers/io_struct.py).

SGLang accepts unknown top-level fields silently, so a misspelt field is never an error there: every request this
project sends is built from one of these dataclasses. ``to_json()`` drops optional fields that are None (the
server then uses its default); ``from_json()`` is strict for requests (an unknown key raises, naming it) and
lenient for responses (servers add fields over versions). ``X.from_json(x.to_json()) == x`` for every type.
No import of sglang here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

FINISH_TYPES = ("stop", "length", "abort")
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


class SchemaError(ValueError):
    """A JSON body does not match the schema; the message names the type and the key."""


class _Json:
    STRICT: ClassVar[bool] = True  # requests: unknown keys are errors
    NESTED: ClassVar[dict[str, type]] = {}  # field -> dataclass type of a nested object

    def to_json(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            out[f.name] = _plain(value)
        return out

    @classmethod
    def from_json(cls, data: Any):
        if not isinstance(data, dict):
            raise SchemaError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown and cls.STRICT:
            raise SchemaError(f"{cls.__name__}: unknown field(s) {unknown}; known: {sorted(names)}")
        kwargs = {}
        for key in names & set(data):
            value = data[key]
            nested = cls.NESTED.get(key)
            kwargs[key] = nested.from_json(value) if nested is not None and value is not None else value
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [k for k in required if k not in kwargs]
        if missing:
            raise SchemaError(f"{cls.__name__}: missing required field(s) {missing}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise SchemaError(f"{cls.__name__}: {e}") from e


def _plain(value: Any) -> Any:
    if isinstance(value, _Json):
        return value.to_json()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ----------------------------------------------------------------------------------------------------------------------
# /generate


@dataclass
class SGLangSamplingParams(_Json):
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    sampling_seed: int | None = None  # honoured by SGLang with --enable-deterministic-inference

    def __post_init__(self) -> None:
        if self.stop_token_ids is not None:
            self.stop_token_ids = [int(t) for t in self.stop_token_ids]


@dataclass
class GenerateRequest(_Json):
    input_ids: list  # list[int] (one prompt) or list[list[int]] (a batch)
    sampling_params: SGLangSamplingParams = field(default_factory=SGLangSamplingParams)
    return_logprob: bool = True
    logprob_start_len: int | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    # MoE (server started with --enable-return-routed-experts): meta_info.routed_experts, the top-k experts of every
    # layer for positions [0, seqlen - 1) (sglang/srt/managers/io_struct.py GenerateReqInput.routed_experts_start_len)
    return_routed_experts: bool | None = None
    # LoRA (server started with --enable-lora): the name of a loaded adapter this request runs with (None: the base)
    lora_path: str | None = None
    NESTED: ClassVar[dict[str, type]] = {"sampling_params": SGLangSamplingParams}

    def __post_init__(self) -> None:
        if not isinstance(self.input_ids, list) or not self.input_ids:
            raise SchemaError("GenerateRequest: input_ids must be a non-empty list of token ids (or of lists)")


@dataclass
class FinishReason(_Json):
    type: str
    matched: int | str | None = None  # the stop token / string that ended generation
    length: int | None = None
    message: str | None = None
    STRICT: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.type not in FINISH_TYPES:
            raise SchemaError(f"FinishReason: type = {self.type!r}: expected one of {FINISH_TYPES}")


@dataclass
class MetaInfo(_Json):
    id: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: FinishReason | None = None
    output_token_logprobs: list | None = None  # [(logprob, token_id, token_text | None), ...]
    weight_version: str | None = None
    # base64 of int32 [seqlen - 1, num_hidden_layers, top-k], C order (sglang/srt/managers/tokenizer_manager.py, the
    # detokenizer encodes it)
    routed_experts: str | None = None
    STRICT: ClassVar[bool] = False
    NESTED: ClassVar[dict[str, type]] = {"finish_reason": FinishReason}

    def __post_init__(self) -> None:
        if self.output_token_logprobs is not None:
            self.output_token_logprobs = [tuple(x) for x in self.output_token_logprobs]

    def to_json(self) -> dict:
        out = super().to_json()
        if "finish_reason" not in out:
            out["finish_reason"] = None  # SGLang reports null while a request is unfinished
        return out


@dataclass
class GenerateResponse(_Json):
    text: str = ""
    output_ids: list[int] | None = None
    meta_info: MetaInfo = field(default_factory=MetaInfo)
    STRICT: ClassVar[bool] = False
    NESTED: ClassVar[dict[str, type]] = {"meta_info": MetaInfo}

    @property
    def token_ids(self) -> list[int]:
        if self.output_ids is not None:
            return [int(t) for t in self.output_ids]
        return [int(t) for _, t, *_ in self.meta_info.output_token_logprobs or []]

    @property
    def logprobs(self) -> list[float]:
        return [float(lp) for lp, *_ in self.meta_info.output_token_logprobs or []]

    @property
    def finish_type(self) -> str:
        fr = self.meta_info.finish_reason
        return fr.type if fr is not None else "abort"


# ----------------------------------------------------------------------------------------------------------------------
# Weight sync, memory, control


@dataclass
class UpdateWeightsFromTensorRequest(_Json):
    serialized_named_tensors: list[str]  # one base64 MultiprocessingSerializer payload per SGLang TP rank
    load_format: str | None = None  # e.g. "flattened_bucket"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


@dataclass
class InitWeightsUpdateGroupRequest(_Json):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


@dataclass
class UpdateWeightsFromDistributedRequest(_Json):
    names: list[str]
    dtypes: list[str]  # torch dtype names without "torch.", e.g. "bfloat16"
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    weight_version: str | None = None
    load_format: str | None = None

    def __post_init__(self) -> None:
        self.shapes = [[int(d) for d in s] for s in self.shapes]
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise SchemaError(
                f"UpdateWeightsFromDistributedRequest: names/dtypes/shapes lengths differ "
                f"({len(self.names)}/{len(self.dtypes)}/{len(self.shapes)})"
            )


@dataclass
class DestroyWeightsUpdateGroupRequest(_Json):
    group_name: str = "weight_update_group"


@dataclass
class UpdateWeightsFromDiskRequest(_Json):
    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


@dataclass
class ReleaseMemoryRequest(_Json):
    tags: list[str] | None = None  # None = all of MEMORY_TAGS

    def __post_init__(self) -> None:
        bad = [t for t in self.tags or [] if t not in MEMORY_TAGS]
        if bad:
            raise SchemaError(f"{type(self).__name__}: unknown memory tag(s) {bad}; known: {MEMORY_TAGS}")


@dataclass
class ResumeMemoryRequest(ReleaseMemoryRequest):
    pass


@dataclass
class BeginWeightUpdateRequest(_Json):
    """Opens a weight-update session: /update_weights_from_tensor and /update_weights_from_distributed answer 400
    outside one (sglang/srt/managers/scheduler_components/weight_updater.py). Disk updates need none."""

    selector: str | None = None  # "target" | "draft" | "all" (SGLang's default)


@dataclass
class EndWeightUpdateRequest(_Json):
    """Closes the session (post-processes the loaded weights); answers success = false when none is open."""


@dataclass
class CheckWeightsRequest(_Json):
    """/weights_checker: ``checksum`` returns one hash per parameter, per TP rank, in SGLang's own (fused) layout."""

    action: str = "checksum"
    skip_tensor_list: list[str] | None = None


@dataclass
class RankChecksums(_Json):
    checksums: dict = field(default_factory=dict)  # SGLang parameter name -> 16 hex digits
    per_gpu_checksum: str = ""
    parallelism_info: list | dict | None = None  # [{role, tp_rank, tp_size, dp_rank, ...}] (a dict in some versions)
    STRICT: ClassVar[bool] = False

    def role_info(self, role: str = "target") -> dict:
        infos = self.parallelism_info if isinstance(self.parallelism_info, list) else [self.parallelism_info or {}]
        return next((i for i in infos if i.get("role", role) == role), {})


@dataclass
class CheckWeightsResponse(_Json):
    success: bool
    message: str = ""
    ranks: list[RankChecksums] = field(default_factory=list)
    STRICT: ClassVar[bool] = False

    @classmethod
    def from_json(cls, data: Any) -> CheckWeightsResponse:
        resp = super().from_json(data)
        resp.ranks = [r if isinstance(r, RankChecksums) else RankChecksums.from_json(r) for r in resp.ranks or []]
        return resp


@dataclass
class AbortRequest(_Json):
    rid: str | None = None
    abort_all: bool = False


@dataclass
class UpdateWeightVersionRequest(_Json):
    new_version: str
    abort_all_requests: bool = True


@dataclass
class SuccessResponse(_Json):
    success: bool
    message: str = ""
    num_paused_requests: int | None = None
    STRICT: ClassVar[bool] = False


@dataclass
class LoadLoRAAdapterRequest(_Json):
    lora_name: str  # what requests name in ``lora_path``
    lora_path: str  # a PEFT folder the server reads
    pinned: bool = False


@dataclass
class UnloadLoRAAdapterRequest(_Json):
    lora_name: str


@dataclass
class LoRAUpdateResponse(_Json):
    success: bool
    error_message: str | None = None
    loaded_adapters: dict | None = None  # name -> path (or a reference object) of every adapter now loaded
    STRICT: ClassVar[bool] = False


# endpoint -> request type (POST JSON bodies this project sends)
ENDPOINTS: dict[str, type] = {
    "/generate": GenerateRequest,
    "/update_weights_from_tensor": UpdateWeightsFromTensorRequest,
    "/init_weights_update_group": InitWeightsUpdateGroupRequest,
    "/update_weights_from_distributed": UpdateWeightsFromDistributedRequest,
    "/destroy_weights_update_group": DestroyWeightsUpdateGroupRequest,
    "/update_weights_from_disk": UpdateWeightsFromDiskRequest,
    "/release_memory_occupation": ReleaseMemoryRequest,
    "/resume_memory_occupation": ResumeMemoryRequest,
    "/begin_weight_update": BeginWeightUpdateRequest,
    "/end_weight_update": EndWeightUpdateRequest,
    "/weights_checker": CheckWeightsRequest,
    "/abort_request": AbortRequest,
    "/update_weight_version": UpdateWeightVersionRequest,
    "/load_lora_adapter": LoadLoRAAdapterRequest,
    "/unload_lora_adapter": UnloadLoRAAdapterRequest,
}
