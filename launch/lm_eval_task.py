"""Write the offline lm-evaluation-harness task fpscale_cloze from held-out documents.

The command itself is fpscale/cli/lm_eval_task.py; this file is its script form.
"""
import sys

from fpscale.cli.lm_eval_task import main

if __name__ == "__main__":
    sys.exit(main())
