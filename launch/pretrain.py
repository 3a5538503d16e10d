"""Pretrain a looped LM.

The command itself is fpscale/cli/pretrain.py (installed as ``fpscale-pretrain``); this file is its
script form, for ``python launch/pretrain.py``, ``deepspeed launch/pretrain.py`` and ``torchrun``.
"""
import sys

from fpscale.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
