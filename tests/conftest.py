import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from repo_builder import build_test_repository  # noqa: E402
from serverproc import REPO_ROOT, Server  # noqa: E402

from shmserve.ipc import shm  # noqa: E402


def _nvml_gpu_count() -> int:
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount()
    except Exception:
        return 0


def pytest_sessionstart(session):
    # an editable install imports a compiled module before its source: tests of an edited
    # module would run the build from before the edit
    from shmserve.ipc import compiled
    stale = compiled.stale()
    if stale:
        pytest.exit(f"compiled from an older source: {', '.join(stale)}; run 'pip install -e .' "
                    f"again (or SHMSERVE_PURE_PYTHON=1 pip install -e . for none)", returncode=4)


def pytest_collection_modifyitems(config, items):
    if _nvml_gpu_count():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU visible through nvidia-ml-py "
                                   "(pip install 'shmserve[gpu]')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def test_repo(tmp_path_factory):
    return build_test_repository(str(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="session")
def example_repo():
    return os.path.join(REPO_ROOT, "configs", "models")


@pytest.fixture(scope="session")
def server(test_repo, example_repo):
    """One server for the read-only and per-request tests, over the example and test models."""
    srv = Server([example_repo, test_repo], "--id", "shmserve-test")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def perf_analyzer():
    """The real perf_analyzer (from the tritonclient 2.51.0 wheel), installed once into the
    cache by bench/install-perf-analyzer.sh; a failed install fails the tests that use it."""
    cache = os.path.expanduser("~/.cache/shmserve-tools")
    script = os.path.join(REPO_ROOT, "bench", "install-perf-analyzer.sh")
    out = subprocess.run(["bash", script, cache], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"installing perf_analyzer failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture
def arena():
    """A real ShmArena of its own, every segment unlinked afterwards."""
    prefix = shm.new_server_prefix()
    a = shm.ShmArena(prefix, chunk_size=2 << 20)
    yield a
    a.close()
    shm.unlink_prefixed(prefix)


@pytest.fixture
def maps():
    """A reader's map of shared-memory segments, closed afterwards."""
    m = shm.ShmMapCache()
    yield m
    m.close()
