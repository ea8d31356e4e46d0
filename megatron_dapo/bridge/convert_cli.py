"""``dapo convert``: the command lines of the checkpoint conversions (``bridge/convert.py``)."""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path


def hf_to_megatron_main(argv=None) -> int:
    """HF safetensors checkpoint → megatron-core dist checkpoint (model only) that the actor loads at any TP/PP.

        dapo convert hf-to-megatron --hf DIR --out DIR --tp 2 --pp 2 [--ep 2] [--model-config qwen2.5-7b] [--dtype bf16]
        dapo convert hf-to-megatron --hf BASE_DIR --adapter PEFT_DIR --out DIR     # a LoRA adapter: adapters alone

    The model config (a name in model_configs/ or a YAML path) is derived from config.json when not given; when given,
    config.json must match it. --tp/--pp/--ep are checked for divisibility (the checkpoint itself holds global tensors).
    Everything is validated before anything is written; a bad input prints one line naming the culprit and exits 2.
    """
    ap = argparse.ArgumentParser(
        prog="dapo convert hf-to-megatron",
        description="HF safetensors checkpoint → megatron-core dist checkpoint (model only) that the actor loads at any TP/PP.",
    )
    ap.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    ap.add_argument("--out", required=True, help="output checkpoint directory")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size to check the architecture against")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to check the architecture against")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size to check the architecture against (MoE)")
    ap.add_argument("--model-config", help="architecture name (model_configs/) or YAML path; default: from config.json")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], help="stored dtype; default: the HF checkpoint's")
    ap.add_argument("--adapter", help="a PEFT LoRA adapter folder on the base --hf: the checkpoint holds the adapters "
                    "alone, and names --hf as its base (model.load of it trains the adapters on)")  # fmt: skip
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)

    from megatron_dapo.bridge.convert import hf_to_megatron
    from megatron_dapo.bridge.convert_lora import peft_to_megatron
    from megatron_dapo.config.typed_yaml import ConfigError

    try:
        if args.adapter:
            arch = peft_to_megatron(args.hf, args.adapter, args.out, args.dtype, args.overwrite)
            print(f"wrote {args.out} (the LoRA adapters of {args.adapter} alone, on the base {args.hf})")
            return 0
        arch = hf_to_megatron(
            args.hf, args.out, args.model_config, args.tp, args.pp, args.dtype, args.overwrite, not args.quiet, args.ep
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    experts = f", {arch.num_experts} experts" if arch.is_moe else ""
    print(f"wrote {args.out} ({arch.family}, {arch.num_layers} layers{experts}, vocab {arch.vocab_size})")
    return 0


def megatron_to_hf_main(argv=None) -> int:
    """megatron-dapo checkpoint (converted or saved by the actor, any TP/PP) → HF safetensors directory.

        dapo convert megatron-to-hf --in DIR --out DIR [--hf-template DIR] [--max-shard-size 2GB]

    Writes sharded safetensors + model.safetensors.index.json + config.json (+ tokenizer / generation files copied from
    the template), loadable by transformers as is. The template's config.json must match the checkpoint's architecture.
    A LoRA run's checkpoint gives the merged model, and its adapters alone as a PEFT folder (--adapter-out, default
    OUT_adapter); one that holds the adapters alone reads its base where it names it.
    Everything is validated before anything is written; a bad input prints one line naming the culprit and exits 2.
    """
    ap = argparse.ArgumentParser(
        prog="dapo convert megatron-to-hf",
        description="megatron-dapo checkpoint (converted or saved by the actor, any TP/PP) → HF safetensors directory.",
    )
    ap.add_argument("--in", dest="src", required=True, help="megatron-dapo checkpoint directory")
    ap.add_argument("--out", required=True, help="output HF directory")
    ap.add_argument("--hf-template", help="HF directory whose config / tokenizer / generation files to reuse")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    ap.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (default 2GB)")
    ap.add_argument("--adapter-out", help="a LoRA checkpoint's adapters as a PEFT folder here (default OUT_adapter)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)

    from megatron_dapo.bridge.convert import read_meta
    from megatron_dapo.bridge.convert_to_hf import megatron_to_hf
    from megatron_dapo.config.typed_yaml import ConfigError

    try:
        arch = megatron_to_hf(
            args.src,
            args.out,
            args.hf_template,
            args.overwrite,
            args.max_shard_size,
            progress=not args.quiet,
            adapter_out=args.adapter_out,
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({arch.family}, {arch.num_layers} layers, vocab {arch.vocab_size})")
    if (Path(args.src) / "dapo_meta.json").is_file() and read_meta(args.src)[1].get("lora"):
        print(f"wrote {args.adapter_out or f'{args.out}_adapter'} (the LoRA adapters alone, in PEFT's format)")
    return 0
