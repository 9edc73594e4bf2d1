"""What the server tells its operator while models load: a line for each load that takes long,
and the status table of every model once start-up has finished (as Triton prints one).

Pure: the scheduler's lifecycle calls these with its clock's time and its model table.
"""
from __future__ import annotations

from shmserve.ipc.messages.to_frontend import ModelInfo

# a load still running this many seconds after it started gets a line, then each time the
# time doubles (5, 10, 20, 40 s...): a 20 s load says so three times, a quick one never
FIRST_REPORT_S = 5.0


class SlowLoads:
    """Which loads in progress are due a "still loading" line."""

    def __init__(self) -> None:
        self.next_report: dict[str, float] = {}     # model -> seconds since start of its next line

    def due(self, loads: dict[str, float], now: float) -> tuple[float, list[str]]:
        """``loads``: model -> when its load started (seconds, the caller's clock). Returns the
        seconds until a line may be due next, and the lines due now."""
        for name in list(self.next_report):
            if name not in loads:
                del self.next_report[name]
        lines, wait = [], 1.0
        for name, started in sorted(loads.items()):
            elapsed = now - started
            at = self.next_report.setdefault(name, FIRST_REPORT_S)
            if elapsed >= at:
                lines.append(f"model '{name}' is still loading ({elapsed:.0f} s so far)")
                while at <= elapsed:
                    at *= 2
                self.next_report[name] = at
            wait = min(wait, max(at - elapsed, 0.05))
        return wait, lines


def status_table(models: list[ModelInfo]) -> str:
    """Model | Version | Status rows for every model version the repository has, its reason
    beside a version that is not ready."""
    rows = [("Model", "Version", "Status")]
    for m in models:
        for v in m.versions:
            status = v.state.value + (f": {v.reason}" if v.reason and
                                      v.state.value != "READY" else "")
            rows.append((m.name, "-" if v.version < 0 else str(v.version), status))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def line(r: tuple[str, str, str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    out = [rule, line(rows[0]), rule, *(line(r) for r in rows[1:]), rule]
    return "\n".join(out)
