"""The language experiments' quick runs train on a small corpus prepared by the data tests' fixture
(a fresh clone has no bundled corpus in cache/)."""
from tests.data.conftest import corpus_file, prepared  # noqa: F401  (pytest fixtures)
