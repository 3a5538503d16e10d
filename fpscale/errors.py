"""Errors that fpscale raises for bad input, each naming what was wrong."""


class ConfigError(ValueError):
    """A configuration value breaks a constraint.

    ``key`` is the dotted path of the offending entry (``solver.max_iter``), so the message
    always tells the user which line of their YAML or which override to fix.
    """

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config key '{key}': {message}")


def check(condition: bool, key: str, message: str) -> None:
    """Raise ``ConfigError(key, message)`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(key, message)


class DataError(ValueError):
    """Bad input data (a corpus, a prepared shard, a tokenizer): the message says which file,
    column or document."""


class ConfigWarning(UserWarning):
    """A configuration value that works, but not as its name suggests (or was adjusted)."""


def warn(key: str, message: str) -> None:
    """Warn about ``key`` the way ``check`` raises: the message names the key."""
    import warnings
    warnings.warn(ConfigWarning(f"config key '{key}': {message}"), stacklevel=3)
