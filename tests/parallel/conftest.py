import pytest

from tests.parallel.launch import PIN, one_process_reference


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """tiny_mixed (every layer type), 5 steps on one process: what every layout must reproduce; and
    run_layout.py's deep-supervision model (``deep_supervision``), which the ZeRO-3 layouts reproduce.
    Every solve at a fixed depth (``PIN``: launch.pinned), as the layouts compared with it."""
    return one_process_reference(str(tmp_path_factory.mktemp("ref_mixed")), "ds=1", PIN)
