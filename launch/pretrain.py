"""Pretrain a looped LM.

The command itself is fpscale/cli/pretrain.py (installed as ``fpscale-pretrain``); this file is its
script form, for ``python launch/pretrain.py``, ``deepspeed launch/pretrain.py`` and ``torchrun``.
"""
import os
import sys

# this checkout's fpscale, whether or not it is installed (python launch/X.py, deepspeed launch/X.py)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fpscale.cli.pretrain import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
