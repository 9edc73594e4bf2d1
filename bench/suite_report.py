"""The suite's Markdown table and PNG chart (bench/suite.py measures, this module only draws)."""
from __future__ import annotations

import operator

_OPS = {"<=": operator.le, ">=": operator.ge}
_UNITS = {"infer_per_s": "infer/s", "p50_ms": "ms p50", "p99_ms": "ms p99"}


def _target_text(target) -> str:
    parts = [target[i:i + 3] for i in range(0, len(target), 3)]
    return ", ".join(f"{_UNITS[f]} {op} {v:g}" if f != "infer_per_s" else f"{op} {v:,} infer/s"
                     for f, op, v in parts)


def target_met(target, result: dict) -> bool:
    parts = [target[i:i + 3] for i in range(0, len(target), 3)]
    return all(_OPS[op](result[f], v) for f, op, v in parts)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def markdown(workloads, floors, results: dict, limits: dict, meta: dict, chart_name: str) -> str:
    lines = [f"# shmserve performance suite ({meta['profile']})", "",
             f"perf_analyzer 2.51, {meta['interval_ms']} ms windows, median of {meta['runs']} "
             f"run(s), {meta['cpus']} CPUs shared with perf_analyzer, {meta['date']}, "
             f"{meta['minutes']:.1f} min. Triton 2.51's numbers come from issue 7 (same kind of "
             f"machine, measured there, not in this run).", "",
             "| workload | Triton infer/s | Triton p50 / p99 ms | target | shmserve infer/s | "
             "shmserve p50 / p99 ms | met |",
             "|---|---:|---:|---|---:|---:|:-:|"]
    for w in workloads:
        r = results[w.key]
        t_rate, t50, t99 = w.triton
        loose = f" ({r['stability']}%)" if r["stability"] > 10 else ""
        lines.append(f"| {w.label}{loose} | {t_rate:,} | {_ms(t50)} / {_ms(t99)} | "
                     f"{_target_text(w.target)} | {r['infer_per_s']:,.0f} | "
                     f"{r['p50_ms']:.3f} / {r['p99_ms']:.3f} | "
                     f"{'yes' if target_met(w.target, r) else 'no'} |")
    lines += ["", "(30%), (60%): perf_analyzer settled only with that stability rule instead of "
              "its default 10% (the quick profile starts at 30%).", "",
              "## Limits of this machine, same run", "",
              "| limit | infer/s | p50 ms | p99 ms |", "|---|---:|---:|---:|"]
    for key, label, *_ in floors:
        r = results[key]
        lines.append(f"| {label} (bench/floor_server.py) | {r['infer_per_s']:,.0f} | "
                     f"{r['p50_ms']:.3f} | {r['p99_ms']:.3f} |")
    lines += ["", f"- numpy memcpy of 4 MiB: {limits['memcpy_4mb_us']:.0f} µs",
              f"- ZeroMQ ipc round trip of 64 B between two processes: "
              f"{limits['zmq_rtt_64b_us']:.0f} µs", "", f"![chart]({chart_name})", ""]
    return "\n".join(lines)


def chart(workloads, floors, results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rate, ax_lat, ax_floor) = plt.subplots(1, 3, figsize=(18, 6),
                                                    gridspec_kw={"width_ratios": [3, 3, 2]})
    labels = [w.label.replace(", ", "\n", 1) for w in workloads]
    x = range(len(workloads))
    width = 0.38
    ours = [results[w.key]["infer_per_s"] for w in workloads]
    theirs = [w.triton[0] for w in workloads]
    ax_rate.bar([i - width / 2 for i in x], theirs, width, label="Triton 2.51 (issue 7)",
                color="#9e9e9e")
    ax_rate.bar([i + width / 2 for i in x], ours, width, label="shmserve", color="#1f77b4")
    ax_rate.set_yscale("log")
    ax_rate.set_ylabel("infer/s (log)")
    ax_rate.set_title("Throughput")
    ax_rate.legend()

    p50 = [results[w.key]["p50_ms"] for w in workloads]
    p99 = [results[w.key]["p99_ms"] for w in workloads]
    t50 = [w.triton[1] if w.triton[1] is not None else float("nan") for w in workloads]
    t99 = [w.triton[2] if w.triton[2] is not None else float("nan") for w in workloads]
    ax_lat.bar([i - width / 2 for i in x], t50, width, color="#9e9e9e", label="Triton p50")
    ax_lat.scatter([i - width / 2 for i in x], t99, marker="_", s=400, color="#616161",
                   label="Triton p99")
    ax_lat.bar([i + width / 2 for i in x], p50, width, color="#1f77b4", label="shmserve p50")
    ax_lat.scatter([i + width / 2 for i in x], p99, marker="_", s=400, color="#0b3c5d",
                   label="shmserve p99")
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("ms (log)")
    ax_lat.set_title("Latency")
    ax_lat.legend(fontsize=8)
    for ax in (ax_rate, ax_lat):
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)

    # concurrency 1: where a small request's time goes, floor by floor
    rows = [(label, results[key]["p50_ms"] * 1000) for key, label, _, _, conc, shape in floors
            if conc == 1 and shape == floors[0][5]]
    by_key = {w.key: w for w in workloads}
    rows += [("shmserve HTTP, c=1", results["http_c1"]["p50_ms"] * 1000),
             ("shmserve gRPC, c=1", results["grpc_c1"]["p50_ms"] * 1000)]
    if "http_c1" in by_key:
        rows.append(("Triton HTTP, c=1", by_key["http_c1"].triton[1] * 1000))
    bars = ax_floor.barh([r[0] for r in rows], [r[1] for r in rows],
                         color=["#c7c7c7"] * (len(rows) - 3) + ["#1f77b4", "#1f77b4", "#9e9e9e"])
    for bar, (label, _) in zip(bars, rows):
        if "unix" in label or "2 zmq" in label:     # alternatives to the shape, not the shape
            bar.set_hatch("//")
            bar.set_facecolor("#ececec")
    ax_floor.set_xlabel("p50 µs, 16 FP32, concurrency 1")
    ax_floor.set_title("Floors under one small request\n(hatched: not shmserve's shape)")
    ax_floor.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
