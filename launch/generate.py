"""Generate text from a trained model (greedy by default; cached decoding).

The command itself is fpscale/cli/generate.py (installed as ``fpscale-generate``); this file is its
script form, for ``python launch/generate.py``, ``deepspeed launch/generate.py`` and ``torchrun``.
"""
import os
import sys

# this checkout's fpscale, whether or not it is installed (python launch/X.py, deepspeed launch/X.py)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fpscale.cli.generate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
