"""What one GPU holds in a training step of a config, and the largest micro-batch that fits.

The command itself is fpscale/cli/plan.py (installed as ``fpscale-plan``); this file is its
script form, for ``python launch/plan.py``.
"""
import sys

from fpscale.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
