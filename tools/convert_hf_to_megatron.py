#!/usr/bin/env python
"""The same as ``dapo convert hf-to-megatron`` (megatron_dapo/bridge/convert_cli.py), from a checkout: --help for the options."""

import sys

from megatron_dapo.bridge.convert_cli import hf_to_megatron_main

if __name__ == "__main__":  # the guard matters: dist_checkpointing starts helper processes
    sys.exit(hf_to_megatron_main())
