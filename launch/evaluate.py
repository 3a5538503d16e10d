"""Evaluate a checkpoint (any layout) on this launch's layout.

The command itself is fpscale/cli/evaluate.py (installed as ``fpscale-evaluate``); this file is its
script form, for ``python launch/evaluate.py``, ``deepspeed launch/evaluate.py`` and ``torchrun``.
"""
import sys

from fpscale.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
