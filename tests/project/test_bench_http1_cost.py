"""bench/http1_cost.py, the in-process cost of an HTTP/1.1 infer request by stage: it runs
against a checkout (this one), checks that each request was answered and parsed, and prints
both tables."""
import os
import subprocess
import sys

from serverproc import REPO_ROOT

BENCH = os.path.join(REPO_ROOT, "bench", "http1_cost.py")


def test_the_bench_measures_both_layers_and_the_codec():
    out = subprocess.run([sys.executable, BENCH, "--against", REPO_ROOT, "--requests", "300",
                          "--rounds", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    names = [r.split("|")[1].strip() for r in rows]
    assert names == ["stage", f"layer of {REPO_ROOT}", "layer of this checkout",
                     "stage", "parse_infer", "render_response", "floor: JSON decode + encode"]
    for r in rows:
        if not r.startswith("| stage"):
            assert float(r.split("|")[2]) > 0
