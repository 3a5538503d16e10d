"""Generate text from a trained model (greedy by default; cached decoding).

The command itself is fpscale/cli/generate.py (installed as ``fpscale-generate``); this file is its
script form, for ``python launch/generate.py``, ``deepspeed launch/generate.py`` and ``torchrun``.
"""
import sys

from fpscale.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
