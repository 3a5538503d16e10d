"""Convert between sharded checkpoints, one safetensors file and a Hugging Face folder.

The command itself is fpscale/cli/convert.py (installed as ``fpscale-convert``); this file is its
script form, for ``python launch/convert.py``, ``deepspeed launch/convert.py`` and ``torchrun``.
"""
import os
import sys

# this checkout's fpscale, whether or not it is installed (python launch/X.py, deepspeed launch/X.py)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fpscale.cli.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
