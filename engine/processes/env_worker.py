"""The start of a worker whose python model has an execution environment (EXECUTION_ENV_PATH).

    python -m shmserve.engine.processes.env_worker '<json WorkerLabel>' <path of a json WorkerArgs file>

``WorkerProcess`` (engine/processes/supervision.py) spawns this instead of the worker. It makes
the environment ready (engine/lifecycle/execution_env.py: unpacked into the run directory once,
checked), then execs ``python -m shmserve.workers.env_start`` (which reads the environment's .pth
files and runs workers/main.py) with the same arguments and the environment's paths set, so the
worker keeps this pid, process group and parent-death signal.
The unpacking runs here, in the worker's own process, not in the scheduler's loop, and within
the model's load timeout. When the environment cannot be used, the reason goes where a worker
that fails to load writes it, and the process exits: the load fails with that reason.
"""
from __future__ import annotations

import logging
import os
import sys
import time

import msgspec

from shmserve.engine.lifecycle import execution_env
from shmserve.ipc import logs
from shmserve.ipc.proc import die_with_parent, failure_path
from shmserve.ipc.spawn_args import WorkerArgs

log = logging.getLogger("shmserve.worker")

WORKER_MODULE = "shmserve.workers.env_start"


def main() -> None:
    label, args_path = sys.argv[1], sys.argv[2]
    with open(args_path, "rb") as f:        # left in place: the worker reads it
        args = msgspec.json.decode(f.read(), type=WorkerArgs)
    die_with_parent(args.parent)
    logs.setup(f"worker {args.spec.instance_name}", settings=args.log, path=args.log_file)
    spec = args.spec
    value = execution_env.requested(spec.backend, spec.config_json, spec.backend_source)
    started = time.monotonic()
    try:
        env = execution_env.prepare(value, spec.model_dir,
                                    os.path.join(args.run_dir, execution_env.CACHE_DIR),
                                    execution_env.Limits.from_environ(os.environ))
    except Exception as e:
        why = str(e) if isinstance(e, execution_env.EnvError) else f"{type(e).__name__}: {e}"
        reason = f"{execution_env.PARAMETER} '{value}' of model '{spec.model_name}': {why}"
        log.error("loading %s failed: %s", spec.instance_name, reason)
        try:
            with open(failure_path(args_path), "w", encoding="utf-8") as f:
                f.write(reason)
        except OSError:
            pass
        logs.flush()
        os._exit(1)
    log.info("model '%s' instance %s: %s", spec.model_name, spec.instance_name,
             execution_env.describe(env, time.monotonic() - started))
    logs.stop()         # written before the exec replaces us
    os.execve(sys.executable, [sys.executable, "-m", WORKER_MODULE, label, args_path],
              execution_env.worker_environ(os.environ, env))


if __name__ == "__main__":
    main()
