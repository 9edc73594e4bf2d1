#!/usr/bin/env python3
"""Run a selection of Triton's own QA suites (its qa/L0_* folders), unchanged, against shmserve.

Each suite is replayed as its test.sh runs it against tritonserver: the same model repositories
(built from qa/python_models etc.; models test.sh copies from Triton's pre-generated
/data/inferenceserver repositories are made with Triton's own generators, ONNX only), the same
server flags, the same unittest/pytest files and classes, and the log greps and exit-code checks
test.sh makes itself. The server takes the fixed ports the QA files hard-code (8000-8002): nothing
else may hold them. Cases that need a GPU, torch, TensorRT, C++ clients or custom C++ backends
are SKIP with the reason.

Not part of the test suite (CI has no copy of Triton's qa/). This is how the team finds where
shmserve still answers differently from Triton.

Usage: python tests/compat/run_triton_qa.py QA_DIR [--suite NAME]... [--json PATH]
           [--examples DIR] [--python-backend DIR] [--tritonserver ANCHOR] [--keep] [-v]
  QA_DIR: the qa/ folder of triton-inference-server/server (it is copied, never changed)
  --examples: that repository's docs/examples/model_repository (default: configs/models here,
              models of the same names and interfaces)
  --python-backend: a checkout of triton-inference-server/python_backend (its examples/ give
              L0_backend_python/decoupled and L0_decoupled their square/repeat models)
  --tritonserver: run the real Triton instead, as ../shared/tools/triton-bench/setup.sh installs
              it under ANCHOR (Triton 2.51 from nvidia-pytriton: the python backend only), to
              learn which failures Triton shares
  --suite: a suite to run (repeatable; a prefix such as L0_backend_python takes its sub-suites);
           default: all of them, in the order below

Prints a table per suite (case, PASS/FAIL/SKIP, one-line reason) and the totals.
"""
from __future__ import annotations

import argparse
import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from qa import harness, report  # noqa: E402
from qa.harness import Case, PortsBusy, Suite, wait_ports_free  # noqa: E402

# suite name -> "module:function" under qa/ that replays it
SUITES = {
    "L0_backend_python": "suite_backend_python:run",
    "L0_backend_python/response_sender": "suite_bp_subs:response_sender",
    "L0_backend_python/async_execute": "suite_bp_subs:async_execute",
    "L0_backend_python/decoupled": "suite_bp_subs:decoupled",
    "L0_backend_python/model_control": "suite_bp_subs:model_control",
    "L0_backend_python/logging": "suite_bp_subs2:logging",
    "L0_backend_python/model_readiness": "suite_bp_subs2:model_readiness",
    "L0_http": "suite_http:run",
    "L0_grpc": "suite_grpc:run",
    "L0_shared_memory": "suite_shared_memory:run",
    "L0_input_validation": "suite_misc:input_validation",
    "L0_parameters": "suite_misc:parameters",
    "L0_client_timeout": "suite_misc:client_timeout",
    "L0_request_cancellation": "suite_decoupled:request_cancellation",
    "L0_decoupled": "suite_decoupled:decoupled",        # the longest: ~1 h of waits
}


class Ctx:
    """What every suite needs: where the copy of qa/ is, the optional sources, the test env."""

    def __init__(self, qa_src: str, work: str, examples: str | None, python_backend: str | None,
                 verbose: bool):
        self.work = work
        self.qa = os.path.join(work, "qa")
        shutil.copytree(qa_src, self.qa, symlinks=True)
        self.examples = os.path.abspath(examples) if examples else None
        self.python_backend = os.path.abspath(python_backend) if python_backend else None
        self.verbose = verbose
        self.suites: list[Suite] = []

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a test process: qa/common (test_util, shm_util, ...) and the
        triton_shm_monitor stand-in and the deselect plugin on PYTHONPATH, as Triton's QA image has them."""
        paths = [os.path.join(self.qa, "common"), os.path.join(HERE, "qa", "pypath")]
        if os.environ.get("PYTHONPATH"):
            paths.append(os.environ["PYTHONPATH"])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}
        for k in ("TRITONSERVER_IPADDR", "TEST_JETSON", "TEST_WINDOWS"):
            env.pop(k, None)
        env.update(extra)
        return env


def use_checkout(work: str) -> str | None:
    """Make every server import shmserve from this checkout, whatever is installed: a folder
    ``shmserve/`` of links to engine/ frontend/ workers/ ipc/, first on the servers' PYTHONPATH
    (pyproject.toml maps the package the same way). Returns a problem, or None."""
    pkg = os.path.join(work, "pkgroot", "shmserve")
    os.makedirs(pkg)
    for part in ("engine", "frontend", "workers", "ipc"):
        os.symlink(os.path.join(ROOT, part), os.path.join(pkg, part))
    paths = [os.path.dirname(pkg)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    harness.SERVER_ENV["PYTHONPATH"] = os.pathsep.join(paths)
    done = subprocess.run([sys.executable, "-c", "import shmserve.engine.launch.cli as m; "
                           "import os; print(os.path.realpath(m.__file__))"],
                          env={**os.environ, **harness.SERVER_ENV}, capture_output=True, text=True,
                          timeout=60)
    where = done.stdout.strip()
    if done.returncode != 0 or not where.startswith(os.path.realpath(ROOT) + os.sep):
        return f"cannot make the server import this checkout ({ROOT}): {where or done.stderr[-300:]}"
    return None


def use_tritonserver(anchor: str) -> str | None:
    """Make every server the real tritonserver under ``anchor`` (triton-bench's layout: its
    binary and backends in triton/, its libraries and numpy in the venv/). Returns a problem."""
    exe = os.path.join(anchor, "triton", "bin", "tritonserver")
    python = os.path.join(anchor, "venv", "bin", "python")
    if not (os.path.exists(exe) and os.path.exists(python)):
        return f"no tritonserver under {anchor} (run triton-bench's setup.sh first)"
    site, libdir = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib']); "
         "print(sysconfig.get_config_var('LIBDIR'))"],
        check=True, capture_output=True, text=True, timeout=60).stdout.split()[:2]
    harness.SERVER_CMD[:] = [exe, f"--backend-directory={anchor}/triton/backends",
                             f"--cache-directory={anchor}/triton/caches", "--allow-gpu-metrics=false"]
    harness.SERVER_ENV.update({"LD_LIBRARY_PATH": f"{site}/nvidia_pytriton.libs:{libdir}",
                               "PYTHONPATH": site,
                               "PATH": f"{anchor}/venv/bin:" + os.environ.get("PATH", "")})
    return None


def run_suite(ctx: Ctx, name: str) -> None:
    """Replay one suite; its Suite objects add themselves to ctx.suites."""
    t0 = time.monotonic()
    print(f"-- {name}", flush=True)
    try:
        module, function = SUITES[name].split(":")
        getattr(importlib.import_module(f"qa.{module}"), function)(ctx)
    except PortsBusy:
        raise
    except Exception as e:                  # noqa: BLE001 - one suite's crash is its FAIL
        import traceback
        Suite(name, ctx).add("(suite)", "FAIL", f"the suite's replay crashed: {type(e).__name__}: "
                             f"{e}", traceback.format_exc())
    print(f"   done in {time.monotonic() - t0:.0f} s", flush=True)


def checkout_state() -> dict:
    """Which code the servers ran: this checkout's commit and its uncommitted product files."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=30)
        return done.stdout.strip() if done.returncode == 0 else ""
    changed = git("status", "--porcelain", "--", "engine", "frontend", "workers", "ipc")
    return {"commit": git("rev-parse", "HEAD"),
            "uncommitted_product_files": [line[3:] for line in changed.splitlines()]}


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("qa_dir")
    p.add_argument("--suite", action="append", default=[])
    p.add_argument("--json")
    p.add_argument("--examples")
    p.add_argument("--python-backend")
    p.add_argument("--tritonserver", metavar="ANCHOR")
    p.add_argument("--keep", action="store_true", help="keep the work folder (logs, repositories)")
    p.add_argument("-v", "--verbose", action="store_true", help="print each case as it ends")
    a = p.parse_args(argv)
    if not os.path.isdir(os.path.join(a.qa_dir, "common")):
        p.error(f"{a.qa_dir} is not Triton's qa/ folder (no common/ in it)")
    wanted = [n for n in SUITES if not a.suite or any(n == s or n.startswith(s.rstrip("/") + "/")
                                                       for s in a.suite)]
    if not wanted:
        p.error(f"no such suite; known: {', '.join(SUITES)}")
    try:
        wait_ports_free(timeout=5)
    except PortsBusy as e:
        print(e, file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="shmserve-triton-qa-")
    problem = use_tritonserver(a.tritonserver) if a.tritonserver else use_checkout(work)
    if problem:
        print(problem, file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
        return 2
    # SIGTERM (timeout, kill) ends the run through the finally blocks that stop the servers
    signal.signal(signal.SIGTERM, _interrupt)
    ctx = Ctx(os.path.abspath(a.qa_dir), work, a.examples, a.python_backend, a.verbose)
    started = {"started": time.strftime("%Y-%m-%d %H:%M:%S"),
               **({"server": "tritonserver " + a.tritonserver} if a.tritonserver else checkout_state())}
    try:
        for name in wanted:
            run_suite(ctx, name)
    except PortsBusy as e:
        print(f"stopped: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted: the tables below hold the cases run so far", file=sys.stderr)
    finally:
        if a.keep:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    by_suite: dict[str, list[Case]] = {}
    for s in ctx.suites:
        by_suite.setdefault(s.name, []).extend(s.cases)
    for name, cases in by_suite.items():
        print()
        print(report.table(name, cases))
    print(report.summary(by_suite))
    if a.json:
        report.write_json(a.json, by_suite, {"qa_dir": os.path.abspath(a.qa_dir),
                                             "examples": ctx.examples,
                                             "python_backend": ctx.python_backend,
                                             "checkout_at_start": started,
                                             "checkout_at_end": checkout_state()})
    return 0 if all(c.status != "FAIL" for cases in by_suite.values() for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
