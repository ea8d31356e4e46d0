#!/usr/bin/env python
"""megatron-dapo checkpoint (converted or saved by the actor, any TP/PP) → HF safetensors directory.

    python tools/convert_megatron_to_hf.py --in DIR --out DIR [--hf-template DIR] [--max-shard-size 2GB]

Writes sharded safetensors + model.safetensors.index.json + config.json (+ tokenizer / generation files copied from
the template), loadable by transformers as is. The template's config.json must match the checkpoint's architecture.
Everything is validated before anything is written; a bad input prints one line naming the culprit and exits 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--in", dest="src", required=True, help="megatron-dapo checkpoint directory")
    ap.add_argument("--out", required=True, help="output HF directory")
    ap.add_argument("--hf-template", help="HF directory whose config / tokenizer / generation files to reuse")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    ap.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (default 2GB)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)

    from megatron_dapo.bridge.convert import megatron_to_hf
    from megatron_dapo.config import ConfigError

    try:
        arch = megatron_to_hf(
            args.src, args.out, args.hf_template, args.overwrite, args.max_shard_size, progress=not args.quiet
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({arch.family}, {arch.num_layers} layers, vocab {arch.vocab_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
