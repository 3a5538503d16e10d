"""Write the offline lm-evaluation-harness task fpscale_cloze from held-out documents.

The command itself is fpscale/cli/lm_eval_task.py; this file is its script form.
"""
import os
import sys

# this checkout's fpscale, whether or not it is installed (python launch/X.py, deepspeed launch/X.py)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fpscale.cli.lm_eval_task import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
