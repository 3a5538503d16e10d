"""What one GPU holds in a training step of a config, and the largest micro-batch that fits.

The command itself is fpscale/cli/plan.py (installed as ``fpscale-plan``); this file is its
script form, for ``python launch/plan.py``.
"""
import os
import sys

# this checkout's fpscale, whether or not it is installed (python launch/X.py, deepspeed launch/X.py)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fpscale.cli.plan import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
