"""Errors fpscale raises, and the exit codes of its commands.

An error that is the user's to fix (a config value, a path, a layout, the data, a checkpoint that
does not fit) is a ``UserError``: every command prints its one-line message, no traceback, and
exits with 2. A few other endings are reported the same way with their own codes (a disk that
filled during a save, a peer rank that vanished). Anything else is not the user's mistake: it
keeps its traceback and exits with Python's code 1, so a bug never looks like a config error.

    0   done
    1   unexpected error (a bug in fpscale or its environment): the traceback says where
    2   user error: the message names the key, file or constraint (``UserError``)
    69  a peer rank vanished (killed, OOM, node failure): the message names it (``PeerLost``)
    74  a disk filled during a checkpoint save; the last complete checkpoint is intact (``StorageFull``)
    75  preempted: every rank saved at a step boundary (fpscale/train/signals.py)
"""

import os
import sys

EXIT_INTERNAL = 1
EXIT_USER = 2
EXIT_PEER_LOST = 69        # sysexits EX_UNAVAILABLE
EXIT_STORAGE = 74          # sysexits EX_IOERR
EXIT_PREEMPTED = 75        # sysexits EX_TEMPFAIL: saved, run the same command again


class ReportedError(Exception):
    """An ending whose message says everything: commands print it in one line and exit with
    ``exit_code`` (fpscale.cli.reported)."""
    exit_code = EXIT_INTERNAL


class UserError(ReportedError):
    """Input the user can fix: a config value, a path, a layout, data or a checkpoint."""
    exit_code = EXIT_USER


class ConfigError(UserError, ValueError):
    """A configuration value breaks a constraint.

    ``key`` is the dotted path of the offending entry (``solver.forward.max_iter``), so the message
    always tells the user which line of their YAML or which override to fix.
    """

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config key '{key}': {message}")


def check(condition: bool, key: str, message: str) -> None:
    """Raise ``ConfigError(key, message)`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(key, message)


class DataError(UserError, ValueError):
    """Bad input data (a corpus, a prepared shard, a tokenizer): the message says which file,
    column or document."""


class LayoutError(UserError, ValueError):
    """A launch that cannot run the config: world size, tensor-parallel split, batch geometry,
    devices per process. The message gives the numbers and a fix."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be read, resumed or converted: the message names the folder or
    file and what is wrong with it."""


class StorageFull(ReportedError):
    """A write ran out of space (or quota, or the file-size limit) during a checkpoint save; the
    message names the file and the last complete checkpoint, which is untouched."""
    exit_code = EXIT_STORAGE


class PeerLost(ReportedError, RuntimeError):
    """A rank of the job stopped (its heartbeat ended) while this one still needed it."""
    exit_code = EXIT_PEER_LOST


class ConfigWarning(UserWarning):
    """A configuration value that works, but not as its name suggests (or was adjusted)."""


class ConfigDeprecation(FutureWarning):
    """A config key in an older form (a flat ``solver.tol``, now ``solver.forward.tol``): it loads, and the
    message names the key to write. A FutureWarning, Python's category for deprecations meant for the user
    (shown by default, as fpscale.models.moved's), not a ConfigWarning (the value works as its name says)."""


def warn(key: str, message: str) -> None:
    """Warn about ``key`` the way ``check`` raises: the message names the key."""
    import warnings
    warnings.warn(ConfigWarning(f"config key '{key}': {message}"), stacklevel=3)


def print_error(message: str) -> None:
    """``error: <message>`` on stderr as one write: the ranks of a job share one stderr (torchrun, srun),
    and ``print`` writes a line in two parts where stderr is unbuffered (``python -u``), so two ranks'
    messages could end on one line (a pipe keeps a write of up to 4 KiB whole)."""
    line = f"error: {message}\n"
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):        # a stand-in stream (pytest's capsys)
        sys.stderr.write(line)
        sys.stderr.flush()
        return
    sys.stderr.flush()
    os.write(fd, line.encode(errors="replace"))
