"""Run a Triton QA file's test cases as its test.sh does, and turn the outcome into Cases.

``run_unittest``: test.sh's ``python3 file.py Class[.test]`` / ``python3 -m unittest ...``. Each
case runs in a process of its own (``python3 -m unittest -v module.Class.test``, in the suite's
folder, in the order unittest sorts them), so that each has its own timeout and a hung case
cannot take the rest with it.
``run_pytest``: test.sh's ``python3 -m pytest file[::Class]``, one process, pytest-timeout for
each case and the verdicts read from the junit XML it writes.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

from .harness import Suite, tail

_LIST = r"""
import sys, unittest
ids = []
def walk(s):
    for t in s:
        walk(t) if isinstance(t, unittest.TestSuite) else ids.append(t.id())
for name in sys.argv[1:]:
    walk(unittest.defaultTestLoader.loadTestsFromName(name))
print("\n".join(ids))
"""


def _short(case_id: str) -> str:
    """module.Class.test -> Class.test"""
    parts = case_id.split(".")
    return ".".join(parts[-2:]) if len(parts) >= 2 else case_id


def _skipped(short: str, skips: dict[str, str]) -> str | None:
    for key, why in skips.items():
        if short == key or short.endswith("." + key):
            return why
    return None


def exception_line(block: str) -> str:
    """The exception a traceback ends with ('AssertionError: ...'), folded to one line."""
    lines = block.rstrip().splitlines()
    start = None
    for i, line in enumerate(lines):
        if line.startswith("  File "):
            start = None
        elif start is None and line and not line.startswith(" ") and i > 0 and (
                lines[i - 1].startswith("    ") or lines[i - 1].startswith("  File ")
                or lines[i - 1].lstrip().startswith(("^", "~"))):
            start = i
    if start is None:
        return " ".join(lines[-3:])[:300]
    text = []
    for line in lines[start:]:
        if line.startswith(("-----", "=====", "During handling", "The above exception")):
            break
        text.append(line.strip())
    return " ".join(t for t in text if t)[:400]


def _failure_blocks(out: str) -> list[str]:
    """unittest's "FAIL: ..."/"ERROR: ..." sections."""
    return re.findall(r"^(?:FAIL|ERROR): .*?(?=^={50,}|^-{50,}\nRan |\Z)", out, re.M | re.S)


def run_unittest(suite: Suite, step: str, cwd: str, names: list[str], env: dict,
                 skips: dict[str, str] | None = None, timeout: float = 180,
                 prefix: str = "") -> list[str]:
    """Every case of ``names`` (module[.Class[.test]]), one process each. Returns the verdicts."""
    skips = skips or {}
    listed = subprocess.run([sys.executable, "-c", _LIST, *names], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=120)
    ids = [i for i in listed.stdout.split() if i]
    if listed.returncode != 0 or not ids:
        suite.add(f"{step}: {prefix}{' '.join(names)}", "FAIL",
                  "could not load the tests: " + exception_line(listed.stderr), listed.stderr)
        return ["FAIL"]
    verdicts = []
    for case_id in ids:
        short = _short(case_id)
        name = f"{step}: {prefix}{short}"
        why = _skipped(short, skips)
        if why:
            suite.skip(name, why)
            verdicts.append("SKIP")
            continue
        if "_FailedTest" in case_id:
            case_id = short.split(".")[-1]          # rerun the failed import for its message
        verdicts.append(run_one_unittest(suite, name, cwd, case_id, env, timeout))
    return verdicts


def run_one_unittest(suite: Suite, name: str, cwd: str, case_id: str, env: dict,
                     timeout: float) -> str:
    t0 = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "unittest", "-v", case_id], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        suite.add(name, "FAIL", f"timed out after {timeout:.0f} s", tail(out + err, 40),
                  time.monotonic() - t0)
        return "FAIL"
    out = done.stdout + done.stderr
    dt = time.monotonic() - t0
    if done.returncode == 0:
        m = re.search(r"\.\.\. skipped '(.*)'", out)
        if m and not re.search(r"\.\.\. ok$", out, re.M):
            suite.add(name, "SKIP", f"the test skips itself: {m.group(1)}", seconds=dt)
            return "SKIP"
        suite.add(name, "PASS", seconds=dt)
        return "PASS"
    blocks = _failure_blocks(out)
    reason = exception_line(blocks[0]) if blocks else f"rc={done.returncode}: " + \
        tail(out, 3).replace("\n", " | ")
    suite.add(name, "FAIL", reason, "\n".join(blocks) or tail(out, 60), dt)
    return "FAIL"


def run_pytest(suite: Suite, step: str, cwd: str, target: str, env: dict,
               skips: dict[str, str] | None = None, timeout: float = 180,
               total_timeout: float = 1800, extra: tuple[str, ...] = ()) -> list[str]:
    """``python3 -m pytest target`` with the cases in ``skips`` (Class.test) deselected."""
    skips = skips or {}
    xml = os.path.join(cwd, f".qa-{step.replace(' ', '_').replace('/', '_')}.xml")
    if os.path.exists(xml):
        os.remove(xml)
    env = {**env, "QA_DESELECT": "\n".join(skips)}
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "qa_deselect",
           "-o", "addopts=", f"--timeout={int(timeout)}", f"--junitxml={xml}", *extra, target]
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=total_timeout)
        out, timed_out = done.stdout + done.stderr, False
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        timed_out = True
    for key, why in skips.items():
        suite.skip(f"{step}: {key}", why)
    verdicts = ["SKIP"] * len(skips)
    if os.path.exists(xml) and not timed_out:
        verdicts += _junit(suite, step, xml)
    else:
        verdicts += _pytest_lines(suite, step, out, timed_out, total_timeout)
    if len(verdicts) == len(skips):
        suite.add(f"{step}: {target}", "FAIL", "pytest ran no test: " +
                  tail(out, 3).replace("\n", " | "), tail(out, 60), time.monotonic() - t0)
        verdicts.append("FAIL")
    return verdicts


def _junit(suite: Suite, step: str, xml: str) -> list[str]:
    verdicts = []
    for tc in ET.parse(xml).getroot().iter("testcase"):
        cls = tc.get("classname", "").split(".")[-1]
        name = f"{step}: {cls + '.' if cls else ''}{tc.get('name')}"
        dt = float(tc.get("time") or 0)
        bad = tc.find("failure")
        if bad is None:
            bad = tc.find("error")
        skipped = tc.find("skipped")
        if bad is not None:
            text = bad.text or ""
            reason = " ".join((bad.get("message") or "").split())[:400] or exception_line(text)
            suite.add(name, "FAIL", reason, text, dt)
            verdicts.append("FAIL")
        elif skipped is not None:
            suite.add(name, "SKIP", "the test skips itself: " + (skipped.get("message") or ""),
                      seconds=dt)
            verdicts.append("SKIP")
        else:
            suite.add(name, "PASS", seconds=dt)
            verdicts.append("PASS")
    return verdicts


def _pytest_lines(suite: Suite, step: str, out: str, timed_out: bool, limit: float) -> list[str]:
    """Verdicts from ``pytest -v`` lines when no XML came (the run was cut off)."""
    verdicts, seen = [], set()
    for m in re.finditer(r"^(\S+?)::(\S+?)::(\S+) (PASSED|FAILED|ERROR|SKIPPED)", out, re.M):
        status = {"PASSED": "PASS", "SKIPPED": "SKIP"}.get(m.group(4), "FAIL")
        key = f"{m.group(2)}.{m.group(3)}"
        seen.add(key)
        suite.add(f"{step}: {key}", status, "" if status == "PASS" else m.group(4))
        verdicts.append(status)
    running = re.findall(r"^(\S+?)::(\S+?)::(\S+) $", out, re.M)
    if timed_out:
        last = f"{running[-1][1]}.{running[-1][2]}" if running else "pytest"
        suite.add(f"{step}: {last}", "FAIL", f"the run was stopped after {limit:.0f} s",
                  tail(out, 40))
        verdicts.append("FAIL")
    return verdicts
