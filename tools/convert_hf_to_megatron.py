#!/usr/bin/env python
"""HF safetensors checkpoint → megatron-core dist checkpoint (model only) that the actor loads at any TP/PP.

    python tools/convert_hf_to_megatron.py --hf DIR --out DIR --tp 2 --pp 2 [--model-config qwen2.5-7b] [--dtype bf16]

The model config (a name in model_configs/ or a YAML path) is derived from config.json when not given; when given,
config.json must match it. --tp/--pp are checked for divisibility (the checkpoint itself holds global tensors).
Everything is validated before anything is written; a bad input prints one line naming the culprit and exits 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    ap.add_argument("--out", required=True, help="output checkpoint directory")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size to check the architecture against")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to check the architecture against")
    ap.add_argument("--model-config", help="architecture name (model_configs/) or YAML path; default: from config.json")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], help="stored dtype; default: the HF checkpoint's")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)

    from megatron_dapo.bridge.convert import hf_to_megatron
    from megatron_dapo.config import ConfigError

    try:
        arch = hf_to_megatron(
            args.hf, args.out, args.model_config, args.tp, args.pp, args.dtype, args.overwrite, progress=not args.quiet
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({arch.family}, {arch.num_layers} layers, vocab {arch.vocab_size})")
    return 0


if __name__ == "__main__":  # the guard matters: dist_checkpointing starts helper processes
    sys.exit(main())
