"""The fork server ("zygote"): one process that has imported what workers need, and forks them.

    python -m shmserve.workers.zygote '<json ZygoteSettings>' '<blank placeholder>'

The scheduler starts it before any model loads (engine/processes/forkserver.py) and asks it for workers
over a socket pair. A worker forked from it shares the interpreter, numpy, pyzmq, msgspec and
shmserve's own modules with every other forked worker, copy-on-write, instead of importing them
again (about 16 MiB of private memory per worker when spawned).

For each ``ForkRequest`` it forks an intermediate process, which forks the worker and exits at
once; the zygote reaps the intermediate, so the worker is re-parented to the nearest subreaper,
the scheduler (engine/supervision.become_subreaper). Only then does the zygote answer with the
worker's pid and, as SCM_RIGHTS, the write end of a pipe the worker waits on: the worker runs
only once the scheduler, holding a pidfd on it, writes "go" there. If the scheduler never got
the answer (the zygote died or timed out), the pipe closes unread and the worker exits before
it did anything, so a worker either runs with the scheduler knowing it, or not at all.

In the worker, before ``shmserve.workers.main.main()`` runs with the same label and arguments
file as a spawned worker: ``setsid`` (a process group of its own), signal dispositions and mask
as a fresh interpreter has them, every inherited descriptor but 0-2 closed, ``random`` and
numpy's global generator re-seeded, and the command line rewritten in place (``set_title``) so
that /proc/<pid>/cmdline reads ``<python> -m shmserve.workers.main <label json>`` as it does
for a spawned worker (NUL-padded to the room the zygote's own arguments took). The worker asks
for its parent-death signal itself (``die_with_parent``), once it is the scheduler's child.

The zygote stays single-threaded: a fork copies only the calling thread, so a lock another
thread held would stay locked in the worker for ever. numpy's OpenBLAS starts its thread pool
at import; the zygote shuts it down (``blas_thread_shutdown_``, which OpenBLAS's own fork
handler calls too) and a worker starts it again at its first BLAS call. onnxruntime 1.x starts
a thread at import, so it is imported here only when a probe child finds that it does not.
Before every fork the zygote checks that it has one thread (``threading.active_count()`` and
/proc/self/task); if not, it refuses for good and the scheduler spawns fresh interpreters.

The zygote writes no log line itself (a synchronous write to a full stderr pipe would stall
it, and a writer thread is what it must not have): what it has to say travels in its answers
(``ZygoteHello.notes``, ``ForkReply.error``) and the scheduler logs it.
"""
from __future__ import annotations

import ctypes
import gc
import importlib
import importlib.util
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

import msgspec

from shmserve.ipc.fork_protocol import ForkReply, ForkRequest, ZygoteHello, ZygoteSettings

# What every worker imports, imported once here. (workers/python_backend/bls.py is left out: it pulls in the
# frontend's request code, and only a model that makes BLS requests needs it.)
PRELOAD = ("numpy", "numpy.random", "ml_dtypes", "msgspec", "zmq",
           "shmserve.ipc.channel", "shmserve.ipc.packets", "shmserve.ipc.shm",
           "shmserve.ipc.logs", "shmserve.ipc.proc",
           "shmserve.workers.main", "shmserve.workers.python_backend.pb_utils",
           "shmserve.workers.python_backend.backend", "shmserve.workers.backends.onnx")
MAYBE_PRELOAD = ("onnxruntime",)     # imported only if the probe finds it starts no thread
PROBE_TIMEOUT_S = 60.0
SETTLE_S = 1.0                        # for a thread just joined to leave /proc/self/task
GO_TIMEOUT_S = 60.0                   # a forked worker waits this long for the scheduler's "go"
REPARENT_TIMEOUT_S = 10.0
ENV_MARK = "SHMSERVE_ZYGOTE"          # set in the zygote's environment (/proc/<pid>/environ)
WORKER_MODULE = "shmserve.workers.main"

# Signal dispositions as the interpreter set them up, before this module changed any: what a
# forked worker restores, so it starts as a spawned one does.
_INITIAL_SIGNALS: dict[int, Any] = {}
_SOCK: socket.socket | None = None     # the zygote's end of the socket pair


def record_signals() -> None:
    for s in signal.valid_signals():
        if s in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            _INITIAL_SIGNALS[s] = signal.getsignal(s)
        except (ValueError, OSError):
            pass


def restore_signals() -> None:
    for s, handler in _INITIAL_SIGNALS.items():
        try:
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        except (ValueError, OSError, TypeError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


def thread_count() -> int:
    """Threads of this process as the kernel sees them (native ones included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def thread_names() -> list[str]:
    names = []
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f"{tid} {f.read().strip()}")
    except OSError:
        pass
    return names


def single_threaded(settle_s: float = 0.0) -> bool:
    """One Python thread and one kernel task. A thread just joined may still be listed in
    /proc/self/task for a moment (the kernel releases it after the join returns), so the
    task count is read again for up to ``settle_s``."""
    if threading.active_count() != 1:
        return False
    deadline = time.monotonic() + settle_s
    while thread_count() != 1:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


def stop_openblas_threads() -> bool:
    """Shut down the thread pool numpy's OpenBLAS started at import (it restarts on the next
    BLAS call, in the worker). What OpenBLAS's own pthread_atfork handler does before a fork."""
    done = False
    seen = set()
    try:
        with open("/proc/self/maps") as f:
            paths = [ln.split()[-1] for ln in f if "openblas" in ln.lower() and "/" in ln]
    except OSError:
        return False
    for path in paths:
        if path in seen:
            continue
        seen.add(path)
        try:
            lib = ctypes.CDLL(path)
            fn = getattr(lib, "blas_thread_shutdown_", None)
        except OSError:
            continue
        if fn is not None:
            fn()
            done = True
    return done


def probe_import(name: str) -> tuple[bool, str]:
    """Whether importing ``name`` leaves a process single-threaded: a forked child imports it
    and reports its thread count, so this process stays as it was if it does not."""
    if importlib.util.find_spec(name) is None:
        return False, "not installed"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            importlib.import_module(name)
            os.write(w, str(thread_count()).encode())
            code = 0
        except BaseException:
            pass
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                break
            chunk = os.read(r, 64)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    if not data:
        return False, "the import failed or hung in a probe"
    threads = int(data)
    if threads != 1:
        return False, f"its import starts {threads - 1} thread(s)"
    return True, ""


def preload(notes: list[str]) -> list[str]:
    loaded = []
    for name in PRELOAD:
        importlib.import_module(name)
        loaded.append(name)
    stop_openblas_threads()
    if single_threaded(SETTLE_S):
        for name in MAYBE_PRELOAD:
            ok, why = probe_import(name)
            if ok:
                importlib.import_module(name)
                loaded.append(name)
            else:
                notes.append(f"{name} not preloaded ({why}): workers import it themselves")
    # the modules' objects now live for ever: keep the collector from writing to them, so the
    # pages they sit on stay shared with every worker
    gc.collect()
    gc.freeze()
    return loaded


# ---- the command line of a forked worker ------------------------------------------------------
def title_room() -> tuple[int, int]:
    """(arg_start, arg_end) of this process: /proc/self/stat fields 48 and 49."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[45]), int(fields[46])     # field 3 is fields[0]


def worker_argv(label: str) -> list[bytes]:
    return [os.fsencode(sys.executable), b"-m", WORKER_MODULE.encode(), label.encode()]


def title_bytes(argv: list[bytes]) -> bytes:
    return b"\0".join(argv) + b"\0"


def set_title(argv: list[bytes]) -> None:
    """Overwrite this process's argument memory with ``argv``, NUL-separated and NUL-padded,
    as setproctitle does, so /proc/<pid>/cmdline shows it (the kernel reads arg_start..arg_end;
    the last byte stays NUL, so it reads them as separate arguments)."""
    start, end = title_room()
    data = title_bytes(argv)
    if len(data) > end - start:
        raise ValueError(f"command line of {len(data)} bytes does not fit in {end - start}")
    data = data.ljust(end - start, b"\0")
    ctypes.memmove(start, data, len(data))


# ---- the worker side of a fork -------------------------------------------------------------------
def close_fds(keep: set[int]) -> None:
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def forget_zygote_files() -> None:
    """Detach the zygote's socket object from its descriptor before that is closed, so that
    nothing closes a reused descriptor number later."""
    if _SOCK is not None:
        _SOCK.detach()


def wait_go(fd: int) -> bool:
    """The scheduler writes one byte once it holds the worker's pidfd; EOF means it never got
    our pid (the zygote died or it gave up on it)."""
    try:
        ready = select.select([fd], [], [], GO_TIMEOUT_S)[0]
        return bool(ready) and os.read(fd, 1) == b"g"
    except OSError:
        return False
    finally:
        os.close(fd)


def wait_reparented(parent: int) -> bool:
    """The intermediate has exited before the zygote answered, so this is normally true at
    once; bounded all the same."""
    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() != parent:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def reseed() -> None:
    import random
    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


def become_worker(req: ForkRequest, go_fd: int) -> None:
    """Runs in the forked worker; never returns."""
    code = 1
    try:
        os.setsid()
        restore_signals()
        forget_zygote_files()
        close_fds({go_fd})
        if not wait_go(go_fd) or not wait_reparented(req.parent):
            os._exit(1)
        reseed()
        os.environ.pop(ENV_MARK, None)
        argv = worker_argv(req.label)
        set_title(argv)
        main = importlib.import_module(WORKER_MODULE)
        sys.argv = [main.__file__ or WORKER_MODULE, req.label, req.args_path]
        sys.orig_argv = [os.fsdecode(a) for a in argv] + [req.args_path]
        sys.modules["__main__"] = main      # as `python -m` would have it, for multiprocessing
        main.main()                         # ends in os._exit
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
        os._exit(code)


# ---- the zygote's loop ---------------------------------------------------------------------------
def fork_worker(req: ForkRequest) -> tuple[int, int]:
    """Fork the worker through an intermediate that exits at once; returns (worker pid, write
    end of its go pipe). The worker is the scheduler's child once this returns."""
    go_r, go_w = os.pipe()
    pid_r, pid_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        mid = os.fork()
    except BaseException:
        for fd in (go_r, go_w, pid_r, pid_w):
            os.close(fd)
        raise
    if mid == 0:                            # the intermediate
        code = 1
        try:
            os.close(pid_r)
            os.close(go_w)
            pid = os.fork()
            if pid == 0:
                os.close(pid_w)
                become_worker(req, go_r)
            os.write(pid_w, str(pid).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(go_r)
    os.close(pid_w)
    try:
        data = b""
        while chunk := os.read(pid_r, 32):
            data += chunk
    finally:
        os.close(pid_r)
        _, status = os.waitpid(mid, 0)
    if not data or os.waitstatus_to_exitcode(status) != 0:
        os.close(go_w)
        raise OSError(f"the intermediate process failed ({status:#x})")
    return int(data), go_w


def serve(sock: socket.socket, parent: int) -> None:
    decode = msgspec.msgpack.Decoder(ForkRequest).decode
    encode = msgspec.msgpack.encode
    refused = ""
    while True:
        try:
            data = sock.recv(1 << 16)
        except ConnectionError:
            return
        if not data:
            return                          # the scheduler closed its end: stop
        if os.getppid() != parent:
            return
        req = decode(data)
        if not refused and not single_threaded(SETTLE_S):
            refused = (f"the fork server has {thread_count()} threads ({', '.join(thread_names())}"
                       f"): forking it is unsafe")
        if refused:
            sock.send(encode(ForkReply(req.seq, error=refused, refuse_for_good=True)))
            continue
        try:
            pid, go_w = fork_worker(req)
        except OSError as e:
            sock.send(encode(ForkReply(req.seq, error=f"fork failed: {e}")))
            continue
        try:
            socket.send_fds(sock, [encode(ForkReply(req.seq, pid))], [go_w])
        finally:
            os.close(go_w)


def main() -> None:
    record_signals()
    settings = msgspec.json.decode(sys.argv[1].encode(), type=ZygoteSettings)
    from shmserve.ipc.proc import die_with_parent
    die_with_parent(settings.parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the launcher owns Ctrl-C
    global _SOCK
    sock = _SOCK = socket.socket(fileno=settings.sock_fd)
    notes: list[str] = []
    loaded = preload(notes)
    start, end = title_room()
    sock.send(msgspec.msgpack.encode(ZygoteHello(os.getpid(), end - start, thread_count(),
                                                 loaded, notes)))
    try:
        serve(sock, settings.parent)
    finally:
        sock.close()
    os._exit(0)


if __name__ == "__main__":
    main()
