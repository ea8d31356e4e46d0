"""Peak RSS of ``save_hf_checkpoint`` on a CPU model: ``python export_mem_worker.py SPEC_JSON OUT_DIR`` prints JSON.

SPEC_JSON: {"arch": {ArchConfig fields}, "dtype": "fp32", "bucket_bytes": N, "max_shard_size": N}. The model is the
canonical parameter dict the export reads (``local_parameters`` stubbed: no megatron model, no process group), every
page written before the measurement. Measured as ``logprob_mem_worker.py`` does (``clear_refs`` 5, then VmHWM, plus a
1 ms RSS sampler): ``model`` the parameters' bytes, ``base`` the resident size before the export, ``peak`` the
high-water mark during it. A first export of a tiny model loads every module the measured one uses.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from logprob_mem_worker import _reset_high_water_mark, _Sampler, _status_kb  # noqa: E402


def main(spec: dict, out: Path) -> None:
    from megatron_dapo.bridge import export
    from megatron_dapo.bridge.convert import DTYPES
    from megatron_dapo.models.arch import ArchConfig
    from megatron_dapo.models.registry import table_for

    dtype = DTYPES[spec.get("dtype", "fp32")]
    kw = {"max_shard_size": spec["max_shard_size"]} if "max_shard_size" in spec else {}

    def model(arch: ArchConfig) -> dict[str, torch.Tensor]:
        return {p.megatron: torch.ones(p.shape(), dtype=dtype) for p in table_for(arch).params(arch)}

    tiny = ArchConfig(name="warm", num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                      num_query_groups=2, vocab_size=40)  # fmt: skip
    local = model(tiny)
    export.local_parameters = lambda chunks, arch: local
    export.save_hf_checkpoint([], tiny, out / "warm", None, spec["bucket_bytes"], **kw)

    arch = ArchConfig(**spec["arch"])
    local = model(arch)
    model_bytes = sum(t.numel() * t.element_size() for t in local.values())
    hwm_reset = _reset_high_water_mark()
    base = _status_kb("VmRSS")
    sampler = _Sampler()
    sampler.start()
    export.save_hf_checkpoint([], arch, out / "hf", None, spec["bucket_bytes"], **kw)
    sampler.done.set()
    sampler.join()
    peak = max(sampler.peak_kb, _status_kb("VmHWM") if hwm_reset else 0)
    print(json.dumps({"model": model_bytes, "base": base << 10, "peak": peak << 10, "hwm_reset": hwm_reset}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]))
