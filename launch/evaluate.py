"""Evaluate a checkpoint (any layout) on this launch's layout.

The command itself is fpscale/cli/evaluate.py (installed as ``fpscale-evaluate``); this file is its
script form, for ``python launch/evaluate.py``, ``deepspeed launch/evaluate.py`` and ``torchrun``.
"""
import os
import sys

# this checkout's fpscale, whether or not it is installed (python launch/X.py, deepspeed launch/X.py)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fpscale.cli.evaluate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
