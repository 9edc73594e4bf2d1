#!/usr/bin/env python3
"""The sequence batcher (issue 17) under 64 concurrent sequences, shmserve against the real Triton
2.51 side by side, measured by perf_analyzer 2.51.

A scratch repository holds configs/models/sequence_accumulator (python, direct strategy,
max_batch_size 8, one instance: 8 sequences live at a time, the others wait in the backlog) and
a copy of it with the oldest strategy, sequence_accumulator_oldest (`oldest {
max_candidate_sequences: 64 max_queue_delay_microseconds: --delay-us preferred_batch_size: [ 8 ] }`:
all 64 sequences live, batches of up to 8 taken from the oldest requests; the model keeps as
many running sums as its config allows live sequences). Every copy gets
max_sequence_idle_microseconds 10 s instead of the default 1 s, so that a perf_analyzer thread
the loaded machine holds back does not find its sequence released.

Both servers load that repository unchanged and are up at once; each row is measured on one,
then at once on the other (the order alternating from row to row and pass to pass, so the
machine's drift falls on both alike), and each cell is the median over --passes. perf_analyzer
runs HTTP, `--concurrency-range 64 --serial-sequences --sequence-length L`: 64 sequences in
flight, each with one request outstanding at a time (without --serial-sequences perf_analyzer
sends a sequence's next request before the previous one is answered, and both servers then
refuse requests that overtake their START); each run takes its own range of sequence ids
(--sequence-id-range). A row that misses a 30% stability rule is measured again and taken from
its windows as they come (marked unstable). onnx_accumulator (ONNX with implicit state, the
server keeps the running sum) is measured on shmserve alone, from a second repository: Triton
2.51 here has only the python backend.

Before measuring, every model is checked on every server: interleaved sequences (8 on direct,
16 on oldest) must get their own running sums back.

Each cell reads infer/s and p50 / p99 ms as perf_analyzer measured them on the client side.
In the direct rows p99 is the backlog: a sequence that finds no free slot (8 of the 64 have one)
waits for others to end, so its first request takes about 7 x a sequence's duration. The table also gives
the average batch (the model's inference_count / execution_count over the run, from
/v2/models/<m>/stats) and the server's CPU per inference (utime + stime of its process tree,
python stubs and workers included). Ratios: shmserve / Triton for infer/s and Triton p50 /
shmserve p50 (above 1: shmserve is ahead). With matplotlib installed it also draws the cells
(--plot). The machine is small and shared: the last line gives how busy the CPUs were before the
run and the load average before and after. Never asserts anything.

  python bench/sequences.py [--quick] [--passes N] [--sequence-length 20] [--delay-us 1000]
                            [--no-triton] [--plot FILE]

About 40 s with --quick (1 s windows, 1 pass) and 2.5 minutes with the defaults (2 s windows,
3 passes) on 2 cores, up to 1 and 4 minutes when other work loads them. Triton comes from
../shared/tools/triton-bench (its setup.sh builds /tmp/triton-bench); perf_analyzer from
bench/install-perf-analyzer.sh.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request

import numpy as np
import tritonclient.http as httpclient

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, HERE)
import run_perf_analyzer  # noqa: E402
from serverproc import Server, cpu_seconds  # noqa: E402

EXAMPLES = os.path.join(REPO, "configs", "models")
DIRECT, OLDEST, ONNX = "sequence_accumulator", "sequence_accumulator_oldest", "onnx_accumulator"
SEQUENCES = 64
IDLE_US = 10_000_000
CHECK_ID = 1 << 40          # the checks' sequence ids, far from perf_analyzer's
# sequence ids per perf_analyzer run, given as "start:end": without an end perf_analyzer 2.51
# refuses a start above 9,112,770 ("The 'end' value must be greater than 'start' value")
IDS_PER_RUN = 1_000_000
# (label, model, on Triton too)
ROWS = [("python, direct", DIRECT, True), ("python, oldest", OLDEST, True),
        ("onnx + implicit state, direct", ONNX, False)]



def repositories(delay_us: int) -> tuple[str, str]:
    """(the repository both servers load, the one shmserve loads besides: onnx_accumulator)."""
    both = tempfile.mkdtemp(prefix="shmserve-bench-seq-")
    shutil.copytree(os.path.join(EXAMPLES, DIRECT), os.path.join(both, DIRECT))
    dst = os.path.join(both, OLDEST)
    shutil.copytree(os.path.join(EXAMPLES, DIRECT), dst)
    cfg_path = os.path.join(dst, "config.pbtxt")
    with open(cfg_path) as f:
        cfg = f.read()
    oldest = (f"oldest {{ max_candidate_sequences: {SEQUENCES} max_queue_delay_microseconds: "
              f"{delay_us} preferred_batch_size: [ 8 ] }}")
    for old, new in ((f'name: "{DIRECT}"', f'name: "{OLDEST}"'), ("direct { }", oldest)):
        if old not in cfg:
            raise RuntimeError(f"{DIRECT}/config.pbtxt changed: no {old!r} to replace")
        cfg = cfg.replace(old, new)
    with open(cfg_path, "w") as f:
        f.write(cfg)
    for model in (DIRECT, OLDEST):
        idle(os.path.join(both, model, "config.pbtxt"))
    alone = tempfile.mkdtemp(prefix="shmserve-bench-seq-onnx-")
    shutil.copytree(os.path.join(EXAMPLES, ONNX), os.path.join(alone, ONNX))
    idle(os.path.join(alone, ONNX, "config.pbtxt"))
    return both, alone


def idle(cfg_path: str) -> None:
    """max_sequence_idle_microseconds IDLE_US: a perf_analyzer thread that the loaded machine
    holds back for over the default 1 s must not find its sequence released (its next request
    would then be refused for lacking START)."""
    with open(cfg_path) as f:
        cfg = f.read()
    if "max_sequence_idle_microseconds" in cfg or "sequence_batching {" not in cfg:
        raise RuntimeError(f"{cfg_path}: no plain 'sequence_batching {{' to add the idle time to")
    with open(cfg_path, "w") as f:
        f.write(cfg.replace("sequence_batching {", "sequence_batching {\n  "
                            f"max_sequence_idle_microseconds: {IDLE_US}", 1))


# ---- the servers -------------------------------------------------------------------------------
def check(url: str, model: str, sequences: int, steps: int = 4) -> None:
    """Interleaved sequences, one request at a time: each must get its own running sum."""
    client = httpclient.InferenceServerClient(url)
    try:
        sums = [0] * sequences
        for step in range(steps):
            for k in range(sequences):
                v = 1 + k * 10 + step
                i = httpclient.InferInput("INPUT", [1, 1], "INT32")
                i.set_data_from_numpy(np.array([[v]], dtype=np.int32))
                r = client.infer(model, [i], sequence_id=CHECK_ID + k, sequence_start=step == 0,
                                 sequence_end=step == steps - 1)
                sums[k] += v
                got = int(r.as_numpy("OUTPUT").reshape(-1)[0])
                if got != sums[k]:
                    raise RuntimeError(f"{url} {model}: sequence {k} step {step} answered {got}, "
                                       f"expected the running sum {sums[k]}")
    finally:
        client.close()


def stats(url: str, model: str) -> tuple[int, int]:
    """(inference_count, execution_count) of the model."""
    with urllib.request.urlopen(f"http://{url}/v2/models/{model}/stats", timeout=10) as r:
        s = json.load(r)["model_stats"][0]
    return int(s["inference_count"]), int(s["execution_count"])


def cpu_busy(seconds: float) -> float:
    """Share of all CPUs busy over the next ``seconds`` (/proc/stat): what else runs here."""
    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + v[4]
        return sum(v) - idle, sum(v)
    b0, t0 = read()
    time.sleep(seconds)
    b1, t1 = read()
    return (b1 - b0) / max(1, t1 - t0)


def measure_row(pa: str, srv: dict, workdir: str, model: str, interval_ms: int,
                length: int, quick: bool, first_id: int) -> dict | None:
    """One perf_analyzer run, its sequence ids from ``first_id`` up (each run its own, so none
    meets a sequence an earlier run left open); None when it failed (the reason goes to
    stderr)."""
    n0, e0 = stats(srv["url"], model)
    c0 = cpu_seconds(srv["pid"])
    try:
        r = run_perf_analyzer.run_one(
            pa, srv["url"], "http", SEQUENCES,
            ["--serial-sequences", "--sequence-length", str(length),
             "--sequence-id-range", f"{first_id}:{first_id + IDS_PER_RUN}"],
            interval_ms, workdir, model=model, stabilities=(30, 1000),
            max_trials=5 if quick else 6)
    except RuntimeError as e:
        print(f"  {srv['name']} {model}: {e}", file=sys.stderr)
        return None
    n1, e1 = stats(srv["url"], model)
    cpu = cpu_seconds(srv["pid"]) - c0
    r["batch"] = (n1 - n0) / max(1, e1 - e0)
    r["cpu_us"] = cpu / max(1, n1 - n0) * 1e6
    print(f"  {srv['name']} {model}: {r['infer_per_s']:,.0f} infer/s, p50 {r['p50_ms']:.2f} ms, "
          f"p99 {r['p99_ms']:.1f} ms, batch {r['batch']:.2f}, {r['cpu_us']:.0f} us CPU/infer"
          f"{' (unstable)' if r['stability'] > 100 else ''}", file=sys.stderr)
    return r


def run(both: str, alone: str, quick: bool, passes: int, length: int, triton: bool,
        interval_ms: int) -> tuple[dict, list]:
    """{server: {model: [result per pass]}}, and the servers' names in table order."""
    pa = run_perf_analyzer.install()
    names = (["Triton"] if triton else []) + ["shmserve"]
    runs: dict[str, dict[str, list]] = {n: {} for n in names}
    with tempfile.TemporaryDirectory(prefix="shmserve-bench-seq-pa-") as work:
        servers: dict[str, dict] = {}
        t = s = None
        try:
            if triton:
                from ensemble import start_triton
                t = start_triton(both, os.path.join(work, "triton.log"), models=[DIRECT, OLDEST])
                servers["Triton"] = {"name": "Triton", "url": t.http_url, "pid": t.pid}
            s = Server([both, alone])
            servers["shmserve"] = {"name": "shmserve", "url": s.url, "pid": s.proc.pid}
            for name, srv in servers.items():
                for _, model, on_triton in ROWS:
                    if name == "shmserve" or on_triton:
                        check(srv["url"], model, 16 if model == OLDEST else 8)
            print(f"  checks passed: interleaved sequences get their own sums on "
                  f"{' and '.join(servers)}", file=sys.stderr)
            i = 0
            for n in range(passes):
                for k, (_, model, on_triton) in enumerate(ROWS):
                    order = [x for x in names if on_triton or x == "shmserve"]
                    if (k + n) % 2:         # Triton first, then shmserve first, row to row
                        order.reverse()     # and pass to pass
                    i += 1
                    for name in order:
                        runs[name].setdefault(model, []).append(measure_row(
                            pa, servers[name], work, model, interval_ms, length, quick,
                            1 + i * IDS_PER_RUN))
                print(f"  pass {n + 1}/{passes} done", file=sys.stderr)
        finally:
            if s is not None:
                s.stop()
            if t is not None:
                t.stop()
    return runs, names


def medians(rs: list) -> dict | None:
    ok = [r for r in rs if r is not None]
    if not ok:
        return None
    out = {k: statistics.median(r[k] for r in ok)
           for k in ("infer_per_s", "p50_ms", "p99_ms", "batch", "cpu_us")}
    out["unstable"] = sum(r["stability"] > 100 for r in ok)
    out["failed"] = len(rs) - len(ok)
    out["n"] = len(rs)
    return out


def report(runs: dict, names: list, passes: int, interval_ms: int, length: int,
           delay_us: int) -> tuple[str, dict]:
    res = {name: {m: medians(rs) for m, rs in by.items()} for name, by in runs.items()}
    head = "| row | model |"
    rule = "|---|---|"
    for name in names:
        head += f" {name} infer/s | {name} p50 / p99 ms | {name} batch | {name} CPU us/infer |"
        rule += "---:|---:|---:|---:|"
    if "Triton" in names:
        head += " infer/s ratio | p50 ratio |"
        rule += "---:|---:|"
    lines = [f"perf_analyzer 2.51, HTTP, {SEQUENCES} concurrent sequences "
             f"(--concurrency-range {SEQUENCES} --serial-sequences), --sequence-length {length} "
             f"(+/- 20%), {interval_ms} ms windows, median of {passes} pass(es); oldest: "
             f"max_candidate_sequences {SEQUENCES}, max_queue_delay_microseconds {delay_us}, "
             f"preferred_batch_size [8]; one instance, max_batch_size 8"
             + ("; Triton 2.51 and shmserve on the same repository, each row on both in turn. "
                "Ratios: shmserve / Triton infer/s and Triton p50 / shmserve p50 (above 1: "
                "shmserve is ahead)" if "Triton" in names else ""), "", head, rule]

    def cell(r: dict | None) -> str:
        if r is None:
            return " failed | | | |"
        mark = ""
        if r["unstable"]:
            mark += f" (unstable {r['unstable']}/{r['n']})"
        if r["failed"]:
            mark += f" (failed {r['failed']}/{r['n']})"
        return (f" {r['infer_per_s']:,.0f}{mark} | {r['p50_ms']:.2f} / {r['p99_ms']:.0f} | "
                f"{r['batch']:.2f} | {r['cpu_us']:.0f} |")
    for label, model, on_triton in ROWS:
        line = f"| {label} | {model} |"
        for name in names:
            r = res[name].get(model)
            line += cell(r) if (on_triton or name == "shmserve") else " n/a | | | |"
        if "Triton" in names:
            a, b = res["Triton"].get(model), res["shmserve"].get(model)
            if a and b:
                line += (f" {b['infer_per_s'] / a['infer_per_s']:.2f} | "
                         f"{a['p50_ms'] / b['p50_ms']:.2f} |")
            else:
                line += " | |"
        lines.append(line)
    lines += ["", "batch: inference_count / execution_count of the model over the run, as "
              "each server counts them. CPU us/infer: utime + stime of the server's process "
              "tree per inference. (unstable k/n): in k of n passes the row missed the 30% "
              "stability rule and its windows were taken as they came; (failed k/n): in k "
              "passes perf_analyzer failed (stderr says why)."]
    return "\n".join(lines), res


def plot(res: dict, names: list, path: str) -> str:
    try:
        import matplotlib
    except ImportError:
        return "no plot: matplotlib is not installed"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [label for label, _, _ in ROWS]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(ROWS))]
        for ax, key, title in zip(axes, ("infer_per_s", "p50_ms", "p99_ms"),
                                  ("infer/s", "p50 ms", "p99 ms")):
            ys = [(res[name].get(m) or {}).get(key, 0) or 0 for _, m, _ in ROWS]
            ax.bar(xs, ys, width, label=name)
            ax.set_title(f"{title}, {SEQUENCES} sequences")
            ax.set_xticks(range(len(ROWS)))
            ax.set_xticklabels(labels, fontsize=8)
    axes[2].set_yscale("log")               # the backlog: from tens of ms to seconds
    axes[0].legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    return f"plot: {path}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="1 s windows, up to 5 per row, 1 pass (under a minute on 2 cores)")
    ap.add_argument("--passes", type=int,
                    help="passes over all rows, cells are medians (default 3; 1 with --quick)")
    ap.add_argument("--sequence-length", type=int, default=20,
                    help="requests per sequence (perf_analyzer varies it by +/- 20%%)")
    ap.add_argument("--delay-us", type=int, default=1000,
                    help="the oldest copy's max_queue_delay_microseconds")
    ap.add_argument("--interval-ms", type=int, help="perf_analyzer windows (2000; 1000 --quick)")
    ap.add_argument("--no-triton", action="store_true", help="shmserve alone")
    ap.add_argument("--plot", default=os.path.join(HERE, "results", "sequences.png"),
                    help="PNG of the cells, if matplotlib is installed")
    a = ap.parse_args()
    passes = a.passes or (1 if a.quick else 3)
    interval = a.interval_ms or (1000 if a.quick else 2000)
    busy = cpu_busy(2.0)
    load0, t0 = os.getloadavg(), time.monotonic()
    both, alone = repositories(a.delay_us)
    try:
        runs, names = run(both, alone, a.quick, passes, a.sequence_length, not a.no_triton,
                          interval)
    finally:
        shutil.rmtree(both, ignore_errors=True)
        shutil.rmtree(alone, ignore_errors=True)
    load1 = os.getloadavg()
    table, res = report(runs, names, passes, interval, a.sequence_length, a.delay_us)
    print(table)
    print(f"\n{os.cpu_count()} CPU(s) shared with perf_analyzer; {busy:.0%} busy in the 2 s "
          f"before the run; load average {load0[0]:.1f} before, {load1[0]:.1f} after; "
          f"{time.monotonic() - t0:.0f} s")
    print(plot(res, names, a.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
