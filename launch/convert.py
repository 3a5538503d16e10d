"""Convert between sharded checkpoints, one safetensors file and a Hugging Face folder.

The command itself is fpscale/cli/convert.py (installed as ``fpscale-convert``); this file is its
script form, for ``python launch/convert.py``, ``deepspeed launch/convert.py`` and ``torchrun``.
"""
import sys

from fpscale.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
