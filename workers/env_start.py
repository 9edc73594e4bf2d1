"""The worker of a model with an execution environment (EXECUTION_ENV_PATH), once
engine/processes/env_worker.py has made the environment ready and exec'ed this with its paths
(its site-packages first on PYTHONPATH, its lib/ first on LD_LIBRARY_PATH).

    python -m shmserve.workers.env_start '<json WorkerLabel>' <path of a json WorkerArgs file>

It reads the environment's .pth files, as those of a site directory are read (an editable install,
a path the environment adds), then imports and runs the worker (workers/main.py). The
environment's packages come first for the worker's own imports too (numpy, pyzmq, msgspec): one
that cannot be imported with them (a numpy built for another ABI, say) fails the model's load
with that reason, rather than with an exit code alone. Only the standard library is used before
the worker is imported.
"""
from __future__ import annotations

import os
import site
import sys
import traceback

SITE_ENV = "SHMSERVE_EXECUTION_ENV_SITE"        # engine/lifecycle/execution_env.py sets it


def main() -> None:
    site_dir = os.environ.get(SITE_ENV, "")
    if site_dir:
        site.addsitedir(site_dir)
    try:
        from shmserve.workers import main as worker
    except Exception as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [""]
        why = " / ".join(lines) if len(lines) <= 3 else f"{lines[0]} ... {lines[-1]}"
        reason = (f"EXECUTION_ENV_PATH: the worker cannot start with the execution environment's "
                  f"packages ({site_dir}) first on its import path: {type(e).__name__}: {why}")
        traceback.print_exc()
        try:    # where the scheduler reads a failed load's reason (ipc/proc.py failure_path)
            with open(sys.argv[2] + ".failed", "w", encoding="utf-8") as f:
                f.write(reason)
        except OSError:
            pass
        os._exit(1)
    sys.argv[0] = worker.__file__ or sys.argv[0]
    sys.modules["__main__"] = worker        # as `python -m` would have it, for multiprocessing
    worker.main()


if __name__ == "__main__":
    main()
