"""Suite-wide markers: every test that starts processes (multiprocess, slurm) is also ``slow``, so
``pytest -m "not slow"`` is the quick in-process loop and plain ``pytest`` runs everything.

One OpenMP thread per process unless OMP_NUM_THREADS is set (as scripts/test.sh sets it; every rank a
test launches has 1), and idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE unless set). With more
than one thread and any other load on the cores (another job, a test's own worker processes), spinning
threads made the in-process tests' many small ops 5-30x slower on the 2-core machine (the quick loop
387 s with OMP_NUM_THREADS=2 against 199 s passive, 181 s with one thread; test_attractor.py and
test_fpmamba2.py 525 s against 21 s), and a second thread did not pay even at load ~3 (116 s with one
thread against 153 s with two, passive). Set here, before anything imports torch (both are read once).
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "run_first: collected first, so a long test starts at once on its own "
                                       "worker beside the rest instead of lengthening the end of the suite")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("multiprocess") or item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("run_first") is None)     # stable: otherwise as collected
