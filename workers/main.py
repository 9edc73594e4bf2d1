"""The worker process: reads its arguments, sets up logging and signals, runs the Worker
(workers/worker.py) and exits.

    python -m shmserve.workers.main '<json WorkerLabel>' <path of a json WorkerArgs file>
"""
from __future__ import annotations

import logging
import os
import signal
import sys

import msgspec

from shmserve.ipc import logs
from shmserve.ipc.proc import PacketWaker, StopFlag, die_with_parent
from shmserve.ipc.spawn_args import WorkerArgs
from shmserve.workers.worker import Worker

log = logging.getLogger("shmserve.worker")


def _exit_now(signum: int) -> None:
    log.warning("second %s: exiting at once, without finishing the batch",
                signal.Signals(signum).name)
    logs.flush(0.5)
    os._exit(1)


def read_args(path: str) -> WorkerArgs:
    """The arguments file the scheduler wrote (argv[1] is only a label for ps)."""
    with open(path, "rb") as f:
        args = msgspec.json.decode(f.read(), type=WorkerArgs)
    os.unlink(path)
    return args


def main() -> None:
    args = read_args(sys.argv[2])
    die_with_parent(args.parent)
    logs.setup(f"worker {args.spec.instance_name}", settings=args.log, path=args.log_file)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher owns Ctrl-C; we obey Shutdown
    waker = PacketWaker()

    def on_sigterm(signum: int) -> None:
        waker(signum)
        log.info("SIGTERM: stopping after the current batch (a second SIGTERM exits at once)")

    stop = StopFlag(signals=(signal.SIGTERM,), on_signal=on_sigterm, on_repeat=_exit_now)
    worker = Worker(args)
    worker.args_path = sys.argv[2]
    # a model sees the argv of Triton's embedded stub, not ours: unittest.main() in a model
    # (Triton's own test models run one) would take our arguments for test names
    sys.argv = [""]
    waker.attach(worker.inbox)
    try:
        if worker.load():
            worker.run(stop)
    finally:
        worker.close(waker)
        logs.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
