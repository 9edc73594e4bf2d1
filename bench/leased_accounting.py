#!/usr/bin/env python3
"""The scheduler's cost per leased request's completion record, in process.

Frontends send the completion records of leased requests in bulk (LeasedDone, every 50 ms);
at concurrency 1 that is ~100 records the scheduler takes in one pass, on a CPU the requests
in flight need (docs/performance.md, "The c=1 tail"). This times that pass on the same
records, interleaved: decoding the message (the floor: what it costs to receive them) and
``Accounting.leased`` (the statistics each record adds).

  python bench/leased_accounting.py [--records 100] [--rounds 7]
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

from shmserve.engine.accounting import Accounting
from shmserve.engine.stats import VersionStats
from shmserve.ipc import messages
from shmserve.ipc.messages.common import LeasedRecord
from shmserve.ipc.messages.to_scheduler import LeasedDone


def records(n: int) -> list[LeasedRecord]:
    now = time.monotonic_ns()
    return [LeasedRecord(1, "identity_fp32", 1, 1, now + i * 500_000, now + i * 500_000 + 200_000,
                         20_000, 30_000, 15_000) for i in range(n)]


def per_record_us(fn, recs, repeat: int = 200) -> float:
    t = time.perf_counter()
    for _ in range(repeat):
        fn(recs)
    return (time.perf_counter() - t) / repeat / len(recs) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    recs = records(a.records)
    wire = messages.encode(LeasedDone(recs))
    acc = Accounting(time.monotonic_ns, lambda *t: None)
    ver = SimpleNamespace(stats=VersionStats("identity_fp32", 1))

    def decode(_):
        messages.decode(wire)

    def leased(rs):
        acc.leased(ver, "identity_fp32", rs)

    rows = {"decode LeasedDone (floor)": decode, "Accounting.leased": leased}
    got: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(a.rounds):
        for name, fn in rows.items():
            got[name].append(per_record_us(fn, recs))
    print(f"{'per leased record':<30} {'µs, median':>11} {'min':>7} {'max':>7}")
    for name, v in got.items():
        print(f"{name:<30} {statistics.median(v):>11.2f} {min(v):>7.2f} {max(v):>7.2f}")
    burst = (statistics.median(got["decode LeasedDone (floor)"]) +
             statistics.median(got["Accounting.leased"])) * a.records / 1000
    print(f"one flush of {a.records} records: about {burst:.2f} ms of scheduler CPU "
          f"(decode + accounting)")


if __name__ == "__main__":
    main()
