"""The command-line entry points (``fpscale-pretrain``, ``fpscale-evaluate``, ``fpscale-convert``,
``fpscale-generate``, ``fpscale-lm-eval-task``); launch/*.py run the same ``main`` as scripts.

Every ``main`` is wrapped in ``reported``: a ``ReportedError`` (a user's mistake, a full disk, a
lost peer) becomes its one-line message and exit code; anything else keeps its traceback and
exits with 1 (the codes: fpscale/errors.py), unless the heartbeat finds that a peer rank vanished
(fpscale/parallel/heartbeat.py): then that is the message, exit 69.
"""
from __future__ import annotations

import functools

from fpscale.errors import ReportedError, print_error


def reported(main):
    """Wrap a command's ``main(argv) -> int``: ``ReportedError`` -> ``error: <message>`` on
    stderr and its ``exit_code``; every other exception propagates (traceback, exit 1)."""
    @functools.wraps(main)
    def wrapper(argv=None) -> int:
        try:
            try:
                return main(argv)
            except ReportedError:
                raise
            except Exception as exc:
                from fpscale.parallel import heartbeat
                heartbeat.settle(exc)       # a peer that vanished: PeerLost naming it
                raise
        except ReportedError as exc:
            print_error(str(exc))
            return exc.exit_code
    return wrapper
