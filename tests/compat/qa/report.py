"""Print the verdicts as one table per suite with totals, and write them as JSON."""
from __future__ import annotations

import json
import shutil
from collections import Counter

from .harness import Case


def counts(cases: list[Case]) -> Counter:
    return Counter(c.status for c in cases)


def table(suite: str, cases: list[Case]) -> str:
    width = shutil.get_terminal_size((160, 20)).columns
    name_w = min(max((len(c.name) for c in cases), default=10), 90)
    lines = [f"== {suite}"]
    for c in cases:
        line = f"{c.status:4}  {c.name:<{name_w}}"
        if c.reason:
            line += f"  {c.reason}"
        line = line.rstrip()
        lines.append(line if len(line) <= max(width, 200) else line[:max(width, 200) - 3] + "...")
    n = counts(cases)
    lines.append(f"   {n['PASS']} pass, {n['FAIL']} fail, {n['SKIP']} skip")
    return "\n".join(lines)


def summary(by_suite: dict[str, list[Case]]) -> str:
    lines = ["", "suite".ljust(40) + "  PASS  FAIL  SKIP"]
    total: Counter = Counter()
    for suite, cases in by_suite.items():
        n = counts(cases)
        total.update(n)
        lines.append(f"{suite:<40}  {n['PASS']:4}  {n['FAIL']:4}  {n['SKIP']:4}")
    lines.append(f"{'total':<40}  {total['PASS']:4}  {total['FAIL']:4}  {total['SKIP']:4}")
    return "\n".join(lines)


def write_json(path: str, by_suite: dict[str, list[Case]], meta: dict) -> None:
    doc = {
        "meta": meta,
        "suites": {s: {"counts": dict(counts(cases)), "cases": [c.as_dict() for c in cases]}
                   for s, cases in by_suite.items()},
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
