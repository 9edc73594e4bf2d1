"""``from cuda.bindings import driver`` gives one ShmIpcDriver per process (one fake GPU)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..",
                                "workers"))
import fake_cuda  # noqa: E402

sys.modules[__name__] = fake_cuda.ShmIpcDriver(devices=1, names=("Fake IPC GPU",))
