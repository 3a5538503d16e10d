"""Suite-wide markers: every test that starts processes (multiprocess, slurm) is also ``slow``, so
``pytest -m "not slow"`` is the quick in-process loop and plain ``pytest`` runs everything."""
import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("multiprocess") or item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.slow)
