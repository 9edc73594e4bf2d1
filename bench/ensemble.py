#!/usr/bin/env python3
"""What an ensemble step costs, measured end to end by real clients in one run (issue 16).

One server on a scratch repository of python identity models (id0..id3, FP32 [-1], one instance
each) and ensembles of them chained (ens_1: id0; ens_2: id0 -> id1; ens_4: id0 -> ... -> id3).
For small (16 FP32) and large (1 MiB FP32) tensors, over HTTP (binary) and gRPC, at c=1:

- the single model id0 (one round trip, the cheapest request);
- ens_1, ens_2, ens_4: one round trip, the server runs the steps and passes the tensors between
  them by shared-memory reference;
- the baseline an ensemble should beat: the client calling id0, id1 (, id2, id3) one after the
  other itself, each answer sent back as the next request's input ("client calls 2 in turn").

Each workload runs for a fixed time per round, the rounds in turn (so the machine's drift falls
on all of them alike); the table gives the median over rounds of p50, p99 and requests/s (one
request = the whole pipeline). Then the per-step overhead: the slope of p50 over 1, 2, 4 steps
(least squares), for the ensemble and for the client's chain, and the ensemble's fixed cost
(ens_1 - id0). With matplotlib installed it also draws p50 against steps (--plot). Never
asserts anything.

--triton: instead, serves the same repository on the real Triton 2.51
(../shared/tools/triton-bench; its setup.sh builds /tmp/triton-bench) and on shmserve, both up
at once, and measures each row with perf_analyzer 2.51 (HTTP, c=1 and c=8; id0, ens_1, ens_2,
ens_4) on one server and at once on the other, the order alternating, then prints the ratios
(about 6 minutes a pass on 2 cores; 2 with --quick, small tensors only).

  python bench/ensemble.py [--quick] [--seconds 2] [--rounds 3] [--no-grpc] [--plot FILE]
  python bench/ensemble.py --triton [--quick] [--passes 3]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, HERE)
from repo_builder import write_model  # noqa: E402
from serverproc import Server, wait_for  # noqa: E402

STEPS = (1, 2, 4)
SIZES = {"small": 16, "large": 1 << 18}         # FP32 elements: 64 B and 1 MiB
IDENTITY = textwrap.dedent('''
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
                for r in requests]
''')
IO = '''
    max_batch_size: 0
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
'''


def repository() -> str:
    """id0..id3 and ens_1, ens_2, ens_4; loads unchanged on Triton 2.51 (python backend)."""
    repo = tempfile.mkdtemp(prefix="shmserve-bench-ensemble-")
    for i in range(max(STEPS)):
        write_model(repo, f"id{i}", f'backend: "python"\n{IO}\n'
                    'instance_group [ { count: 1, kind: KIND_CPU } ]\n', IDENTITY)
    for n in STEPS:
        steps = []
        for i in range(n):
            src = "INPUT0" if i == 0 else f"t{i}"
            dst = "OUTPUT0" if i == n - 1 else f"t{i + 1}"
            steps.append(f'{{ model_name: "id{i}" model_version: -1 '
                         f'input_map {{ key: "INPUT0" value: "{src}" }} '
                         f'output_map {{ key: "OUTPUT0" value: "{dst}" }} }}')
        write_model(repo, f"ens_{n}", f'platform: "ensemble"\n{IO}\n'
                    f'ensemble_scheduling {{ step [\n  ' + ",\n  ".join(steps) + "\n] }\n", None)
        os.makedirs(os.path.join(repo, f"ens_{n}", "1"), exist_ok=True)
    return repo


# ---- the client's side -------------------------------------------------------------------------
class Client:
    """One protocol's client: ``call(model, x)`` -> the model's OUTPUT0."""

    def __init__(self, protocol: str, srv: Server):
        self.module = httpclient if protocol == "http" else grpcclient
        self.client = self.module.InferenceServerClient(
            srv.url if protocol == "http" else srv.grpc_url)
        self.outputs = [self.module.InferRequestedOutput("OUTPUT0")]

    def call(self, model: str, x: np.ndarray) -> np.ndarray:
        i = self.module.InferInput("INPUT0", list(x.shape), "FP32")
        i.set_data_from_numpy(x)
        return self.client.infer(model, [i], outputs=self.outputs).as_numpy("OUTPUT0")

    def close(self) -> None:
        self.client.close()


def workloads() -> list[tuple[str, str, list[str]]]:
    """(key, label, the models one pipeline calls: one, or several in turn from the client)."""
    out = [("single", "id0 (one model)", ["id0"])]
    out += [(f"ens_{n}", f"ensemble of {n}", [f"ens_{n}"]) for n in STEPS]
    out += [(f"client_{n}", f"client calls {n} in turn", [f"id{i}" for i in range(n)])
            for n in STEPS if n > 1]
    return out


def run_for(client: Client, models: list[str], x: np.ndarray, seconds: float,
            min_requests: int = 20) -> dict:
    """c=1 for ``seconds`` (and at least ``min_requests`` pipelines): p50, p99 ms, requests/s."""
    lat = []
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        y = x
        for m in models:
            y = client.call(m, y)
        t1 = time.perf_counter()
        lat.append((t1 - t0) * 1e3)
        if t1 - start >= seconds and len(lat) >= min_requests:
            break
    if y.shape != x.shape or y[0] != x[0]:
        raise RuntimeError(f"{' -> '.join(models)} answered a different tensor")
    q = np.percentile(lat, [50, 99])
    return {"p50": float(q[0]), "p99": float(q[1]), "rate": len(lat) / (t1 - start),
            "n": len(lat)}


def measure(srv: Server, protocols: list[str], seconds: float, rounds: int) -> dict:
    """(protocol, size, workload key) -> median over rounds of each of p50, p99, rate."""
    runs: dict[tuple[str, str, str], list[dict]] = {}
    clients = {p: Client(p, srv) for p in protocols}
    xs = {s: np.linspace(0, 1, n, dtype=np.float32) for s, n in SIZES.items()}
    try:
        for p in protocols:                  # warm-up: every model, every size
            for x in xs.values():
                for _, _, models in workloads():
                    run_for(clients[p], models, x, 0, 5)
        for r in range(rounds):
            for p in protocols:
                for size, x in xs.items():
                    for key, _, models in workloads():
                        runs.setdefault((p, size, key), []).append(
                            run_for(clients[p], models, x, seconds))
            print(f"  round {r + 1}/{rounds} done", file=sys.stderr)
    finally:
        for c in clients.values():
            c.close()
    return {k: {f: statistics.median(v[f] for v in vs) for f in ("p50", "p99", "rate", "n")}
            for k, vs in runs.items()}


def slope(ys: list[float]) -> float:
    """ms per step: least squares of p50 over STEPS."""
    return float(np.polyfit(STEPS, ys, 1)[0])


def report(res: dict, protocols: list[str], seconds: float, rounds: int) -> str:
    lines = [f"c=1, {seconds:g} s per workload per round, median of {rounds} round(s), "
             f"{os.cpu_count()} CPU(s) shared with the client", "",
             "| protocol | tensor | workload | p50 ms | p99 ms | pipelines/s |",
             "|---|---|---|---:|---:|---:|"]
    for p in protocols:
        for size, n in SIZES.items():
            tensor = f"{size} ({n * 4:,} B)"
            for key, label, _ in workloads():
                r = res[(p, size, key)]
                lines.append(f"| {p} | {tensor} | {label} | {r['p50']:.3f} | {r['p99']:.3f} | "
                             f"{r['rate']:,.0f} |")
    lines += ["", "Per-step overhead (slope of p50 over 1, 2, 4 steps); fixed cost = ensemble of "
              "1 - the model alone; saved = client x4 / ensemble of 4 (p50).", "",
              "| protocol | tensor | ensemble ms/step | client ms/step | ensemble fixed ms | "
              "saved at 4 steps |", "|---|---|---:|---:|---:|---:|"]
    for p in protocols:
        for size in SIZES:
            def p50(key: str) -> float:
                return res[(p, size, key)]["p50"]
            ens = [p50(f"ens_{n}") for n in STEPS]
            cli = [p50("single")] + [p50(f"client_{n}") for n in STEPS if n > 1]
            lines.append(f"| {p} | {size} | {slope(ens):.3f} | {slope(cli):.3f} | "
                         f"{ens[0] - cli[0]:+.3f} | {cli[-1] / ens[-1]:.2f}x |")
    return "\n".join(lines)


def plot(res: dict, protocols: list[str], path: str) -> str:
    try:
        import matplotlib
    except ImportError:
        return "no plot: matplotlib is not installed"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(protocols), len(SIZES), squeeze=False,
                             figsize=(5 * len(SIZES), 4 * len(protocols)))
    for ax, (p, size) in zip(axes.flat, [(p, s) for p in protocols for s in SIZES]):
        ens = [res[(p, size, f"ens_{n}")]["p50"] for n in STEPS]
        cli = [res[(p, size, "single")]["p50"]] + \
            [res[(p, size, f"client_{n}")]["p50"] for n in STEPS if n > 1]
        ax.plot(STEPS, ens, "o-", label="ensemble (one request)")
        ax.plot(STEPS, cli, "s--", label="client calls the steps in turn")
        ax.set_title(f"{p}, {size} ({SIZES[size] * 4:,} B)")
        ax.set_xlabel("identity steps")
        ax.set_ylabel("p50 ms, c=1")
        ax.set_xticks(STEPS)
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    return f"plot: {path}"


# ---- --triton: the same repository on Triton 2.51 and shmserve, measured by perf_analyzer ----
TRITON_BENCH = os.path.join(os.path.dirname(REPO), "shared", "tools", "triton-bench")
PA_MODELS = ["id0", *(f"ens_{n}" for n in STEPS)]


def start_triton(repo: str, log_path: str, deadline_s: float = 120, models=PA_MODELS):
    """Triton 2.51 from $ANCHOR (default /tmp/triton-bench), started as triton-bench does;
    returns once ``models`` are ready (also used by bench/streaming.py)."""
    sys.path.insert(0, TRITON_BENCH)
    import sbs_server
    if not os.path.exists(f"{sbs_server.ANCHOR}/triton/bin/tritonserver"):
        raise RuntimeError(f"no Triton in {sbs_server.ANCHOR}: run "
                           f"ANCHOR={sbs_server.ANCHOR} bash {TRITON_BENCH}/setup.sh first")
    srv = sbs_server.start("triton", repo, log_path)

    def ready() -> bool:
        if not srv.alive():
            raise RuntimeError(f"tritonserver exited:\n{srv.log_text()[-3000:]}")
        try:
            return all(sbs_server.http_get(f"http://{srv.http_url}/v2/models/{m}/ready")[0] == 200
                       for m in models)
        except OSError:
            return False
    try:
        wait_for(ready, deadline_s, "Triton to load the repository", interval=0.2)
    except BaseException:
        srv.stop()
        raise
    return srv


def perf_analyzer_row(pa: str, url: str, workdir: str, interval_ms: int, model: str, size: str,
                      c: int, quick: bool) -> dict:
    """A 30% stability rule (perf_analyzer's default 10% rarely settles on 2 shared cores); a
    row that does not settle is measured again and taken from windows as they come (marked
    unstable)."""
    import run_perf_analyzer
    r = run_perf_analyzer.run_one(pa, url, "http", c, ["--shape", f"INPUT0:{SIZES[size]}"],
                                  interval_ms, workdir, model=model, stabilities=(30, 1000),
                                  max_trials=5 if quick else 6)
    print(f"  {url} {model} {size} c={c}: {r['infer_per_s']:,.0f} infer/s, "
          f"p50 {r['p50_ms']:.3f} ms", file=sys.stderr)
    return r


def side_by_side(repo: str, quick: bool, passes: int) -> str:
    """Both servers up at once on the same repository; each row is measured on one, then at
    once on the other (the order alternating from row to row), so the machine's drift falls
    on both alike; with several passes, each cell is the median over them."""
    import run_perf_analyzer
    pa = run_perf_analyzer.install()
    interval = 1000 if quick else 1500
    concurrencies = [1, 8]
    sizes = ["small"] if quick else list(SIZES)
    rows = [(size, m, c) for size in sizes for m in PA_MODELS for c in concurrencies]
    runs: dict[str, dict] = {"triton": {}, "shmserve": {}}
    with tempfile.TemporaryDirectory(prefix="shmserve-bench-ens-pa-") as work:
        t = start_triton(repo, os.path.join(work, "triton.log"))
        try:
            s = Server(repo)
            try:
                urls = {"triton": t.http_url, "shmserve": s.url}
                for n in range(passes):
                    for i, key in enumerate(rows):
                        order = ("triton", "shmserve") if (i + n) % 2 == 0 else \
                            ("shmserve", "triton")
                        for name in order:
                            runs[name].setdefault(key, []).append(perf_analyzer_row(
                                pa, urls[name], work, interval, key[1], key[0], key[2], quick))
            finally:
                s.stop()
        finally:
            t.stop()
    res = {name: {key: {"infer_per_s": statistics.median(r["infer_per_s"] for r in rs),
                        "p50_ms": statistics.median(r["p50_ms"] for r in rs),
                        "p99_ms": statistics.median(r["p99_ms"] for r in rs),
                        "unstable": sum(r["stability"] > 100 for r in rs)}
                  for key, rs in by_key.items()}
           for name, by_key in runs.items()}
    lines = [f"perf_analyzer 2.51, HTTP, {interval} ms windows, the same repository on Triton "
             f"2.51 and shmserve, each row on both servers in turn, median of {passes} "
             f"pass(es); ratios: shmserve / Triton infer/s and Triton p50 / shmserve p50 "
             f"(above 1: shmserve is ahead)", "",
             "| tensor | model | c | Triton infer/s | Triton p50 / p99 ms | shmserve infer/s | "
             "shmserve p50 / p99 ms | infer/s ratio | p50 ratio |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]

    def mark(r: dict) -> str:
        return f" (unstable {r['unstable']}/{passes})" if r["unstable"] else ""
    for key in res["triton"]:
        size, model, c = key
        a, b = res["triton"][key], res["shmserve"][key]
        lines.append(f"| {size} | {model} | {c} | {a['infer_per_s']:,.0f}{mark(a)} | "
                     f"{a['p50_ms']:.3f} / {a['p99_ms']:.3f} | {b['infer_per_s']:,.0f}{mark(b)} | "
                     f"{b['p50_ms']:.3f} / {b['p99_ms']:.3f} | "
                     f"{b['infer_per_s'] / a['infer_per_s']:.2f} | "
                     f"{a['p50_ms'] / b['p50_ms']:.2f} |")
    lines += ["", "Per ensemble step on each server (slope of p50 over ensembles of 1, 2, 4, c=1):",
              ""]
    for size in sizes:
        for name in ("triton", "shmserve"):
            ys = [res[name][(size, f"ens_{n}", 1)]["p50_ms"] for n in STEPS]
            lines.append(f"- {size}, {name}: {slope(ys):.3f} ms per step")
    lines.append("\nEvery row used a 30% stability rule; (unstable k/n): in k of the n passes it "
                 "did not settle, and its windows were taken as they came.")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="0.5 s per workload, 1 round (under a minute); --triton: small "
                         "tensors only, 1 s windows")
    ap.add_argument("--seconds", type=float, help="per workload per round (default 1.5)")
    ap.add_argument("--rounds", type=int, help="rounds, the table gives medians (default 3)")
    ap.add_argument("--no-grpc", action="store_true", help="HTTP only")
    ap.add_argument("--plot", default=os.path.join(HERE, "results", "ensemble.png"),
                    help="PNG of p50 against steps, if matplotlib is installed")
    ap.add_argument("--triton", action="store_true",
                    help="the same repository on Triton 2.51 and shmserve with perf_analyzer")
    ap.add_argument("--passes", type=int,
                    help="--triton: passes over all rows, cells are medians (default 1)")
    a = ap.parse_args()
    seconds = a.seconds if a.seconds is not None else (0.5 if a.quick else 1.5)
    rounds = a.rounds if a.rounds is not None else (1 if a.quick else 3)
    protocols = ["http"] if a.no_grpc else ["http", "grpc"]
    repo = repository()
    t0 = time.monotonic()
    try:
        if a.triton:
            print(side_by_side(repo, a.quick, a.passes or 1))
        else:
            srv = Server(repo)
            try:
                res = measure(srv, protocols, seconds, rounds)
                stats = urllib.request.urlopen(f"{srv.base}/v2/models/ens_4/stats", timeout=10)
                failed = json.load(stats)["model_stats"][0]["inference_stats"]["fail"]["count"]
            finally:
                srv.stop()
            print(report(res, protocols, seconds, rounds))
            print(f"\nens_4 failures on the server: {failed}")
            print(plot(res, protocols, a.plot))
    finally:
        shutil.rmtree(repo, ignore_errors=True)
    print(f"wall time: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
