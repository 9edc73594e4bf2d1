#!/usr/bin/env python3
"""GPU benchmark: a ResNet-sized convolution network served by shmserve on a GPU, against
onnxruntime-gpu run in this process (the limit: the same session work without a server), and a
64 MiB identity through CUDA shared memory against one device-to-device cudaMemcpy.

The network is built here with onnx's helper (no download): a ResNet-50-like stack of 3x3
convolutions (stem 7x7/2, four stages with stride-2 transitions, global average pool, a
1000-way classifier), about 25 M parameters, input [1, 3, 224, 224] FP32. Requests go through
HTTP with binary tensors (tritonclient.http) at concurrency 1 and 16; the server batches them
(dynamic batching, max_batch_size 16). The limit at c=1 is a batch-1 session.run loop, at c=16
a batch-16 loop (its images per second), both with host arrays in and out, as the server's
worker has them. The CUDA shared-memory row registers two regions made with tritonclient's
cuda_shared_memory (cudaMalloc + cudaIpcGetMemHandle here) and runs an onnxruntime identity on
KIND_GPU with its input and output in them (the input bound on the device where it is, the
output copied host to device into the client's region); it is skipped only where tritonclient's
CUDA module cannot run, and a server that refuses the regions fails the bench.

  python3 bench/gpu_bench.py [--seconds 5] [--json PATH]
  python3 bench/gpu_bench.py --cpu-dry-run     # tiny network, CPU provider, KIND_CPU: checks
                                               # the script itself on a machine without a GPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

FULL = {"width": 64, "image": 224, "blocks": (2, 2, 3, 1), "classes": 1000}
TINY = {"width": 4, "image": 32, "blocks": (1, 1, 1, 1), "classes": 10}
MAX_BATCH = 16
IDENTITY_MIB = 64


@dataclass
class Row:
    what: str
    concurrency: str
    per_s: float | None = None          # inferences (images) per second
    p50_ms: float | None = None
    p99_ms: float | None = None
    vs_limit: float | None = None
    note: str = ""


# -- the model ------------------------------------------------------------------------------

def build_convnet(path: str, width: int, image: int, blocks, classes: int, seed: int = 0) -> int:
    """Write the network to ``path``; returns its parameter count."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    count = 0

    def conv(x, cin, cout, k, stride, name):
        nonlocal count
        w = rng.standard_normal((cout, cin, k, k), dtype=np.float32)
        w *= np.float32(np.sqrt(2.0 / (cin * k * k)))
        b = np.zeros(cout, np.float32)
        inits.extend([numpy_helper.from_array(w, f"{name}_w"), numpy_helper.from_array(b, f"{name}_b")])
        count += w.size + b.size
        nodes.append(helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [f"{name}_c"],
                                      kernel_shape=[k, k], strides=[stride, stride],
                                      pads=[k // 2] * 4, name=name))
        nodes.append(helper.make_node("Relu", [f"{name}_c"], [f"{name}_r"]))
        return f"{name}_r"

    x = conv("INPUT0", 3, width, 7, 2, "stem")
    cin = width
    for stage, n in enumerate(blocks):
        cout = width * 2 ** (stage + 1) if stage else width * 2
        x = conv(x, cin, cout, 3, 2, f"s{stage}_down")
        for i in range(n):
            x = conv(x, cout, cout, 3, 1, f"s{stage}_{i}")
        cin = cout
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["pooled"]))
    nodes.append(helper.make_node("Flatten", ["pooled"], ["flat"], axis=1))
    w = rng.standard_normal((cin, classes), dtype=np.float32) * np.float32(1 / np.sqrt(cin))
    b = np.zeros(classes, np.float32)
    inits.extend([numpy_helper.from_array(w, "fc_w"), numpy_helper.from_array(b, "fc_b")])
    count += w.size + b.size
    nodes.append(helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["OUTPUT0"]))
    graph = helper.make_graph(
        nodes, "convnet",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 3, image, image])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", classes])],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return count


def build_identity(path: str) -> None:
    import onnx
    from onnx import TensorProto, helper
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], "identity",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["n"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


def write_repository(root: str, shape: dict, gpu: bool) -> str:
    repo = os.path.join(root, "models")
    kind = "KIND_GPU" if gpu else "KIND_CPU"
    os.makedirs(os.path.join(repo, "convnet", "1"))
    params = build_convnet(os.path.join(repo, "convnet", "1", "model.onnx"), **shape)
    image = shape["image"]
    with open(os.path.join(repo, "convnet", "config.pbtxt"), "w") as f:
        f.write(f'''backend: "onnxruntime"
max_batch_size: {MAX_BATCH}
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 3, {image}, {image} ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ {shape["classes"]} ] }} ]
instance_group [ {{ kind: {kind}, count: 1 }} ]
dynamic_batching {{ max_queue_delay_microseconds: 100 }}
''')
    os.makedirs(os.path.join(repo, "identity_gpu", "1"))
    build_identity(os.path.join(repo, "identity_gpu", "1", "model.onnx"))
    with open(os.path.join(repo, "identity_gpu", "config.pbtxt"), "w") as f:
        f.write(f'''backend: "onnxruntime"
max_batch_size: 0
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] }} ]
instance_group [ {{ kind: {kind}, count: 1 }} ]
''')
    with open(os.path.join(root, "params"), "w") as f:
        f.write(str(params))
    return repo


# -- measuring ------------------------------------------------------------------------------

def _percentile(ms: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(ms), q)) if ms else float("nan")


def in_process(model_path: str, x: np.ndarray, seconds: float, gpu: bool) -> tuple[float, list[float]]:
    """session.run loop (host arrays in and out): runs per second and latencies (ms)."""
    import onnxruntime as ort
    if gpu:
        getattr(ort, "preload_dlls", lambda: None)()
        providers = [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    session = ort.InferenceSession(model_path, providers=providers)
    if gpu and "CUDAExecutionProvider" not in session.get_providers():
        raise SystemExit("onnxruntime did not start its CUDA execution provider")
    for _ in range(3):
        session.run(None, {"INPUT0": x})
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        session.run(None, {"INPUT0": x})
        times.append((time.perf_counter() - t) * 1e3)
    return len(times) / sum(times) * 1e3, times


def through_server(url: str, x: np.ndarray, concurrency: int, seconds: float) -> tuple[float, list[float]]:
    """``concurrency`` clients (a thread and a client each) sending binary HTTP requests back to
    back for ``seconds``: requests per second and latencies (ms)."""
    import tritonclient.http as httpclient
    lat: list[list[float]] = [[] for _ in range(concurrency)]
    errors: list[BaseException] = []
    start = threading.Barrier(concurrency + 1)
    window = {}

    def client(k: int) -> None:
        c = None
        try:
            c = httpclient.InferenceServerClient(url, network_timeout=120)
            inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
            for _ in range(2):
                c.infer("convnet", [inp], outputs=[out])     # warm: connection, first batch
            start.wait(timeout=180)
            while time.perf_counter() < window["end"]:
                t = time.perf_counter()
                c.infer("convnet", [inp], outputs=[out])
                lat[k].append((time.perf_counter() - t) * 1e3)
        except BaseException as e:       # noqa: BLE001 - reported after the run
            errors.append(e)
            start.abort()
        finally:
            if c is not None:
                c.close()

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(concurrency)]
    window["end"] = time.perf_counter() + 1e9       # set for real once every client is warm
    for t in threads:
        t.start()
    try:
        start.wait(timeout=240)
    except threading.BrokenBarrierError:
        pass
    t0 = time.perf_counter()
    window["end"] = t0 + seconds
    for t in threads:
        t.join(timeout=seconds + 120)
    elapsed = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} client(s) failed: {errors[0]!r}")
    flat = [v for per in lat for v in per]
    return len(flat) / elapsed, flat


def d2d_memcpy_ms(nbytes: int, iters: int = 20) -> float:
    from shmserve.ipc.gpu import device as gpu
    cuda = gpu.cuda(0)
    a, b = cuda.alloc(nbytes), cuda.alloc(nbytes)
    stream = cuda.stream()
    try:
        times = []
        for _ in range(iters + 2):
            t = time.perf_counter()
            cuda.dtod(b, a, nbytes, stream)
            cuda.synchronize(stream)
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times[2:])
    finally:
        cuda.destroy_stream(stream)
        cuda.free(a)
        cuda.free(b)


def cuda_shm_identity(url: str, nbytes: int, iters: int = 10) -> tuple[list[float] | None, str]:
    """Identity of ``nbytes`` with input and output in CUDA shared memory: latencies (ms), or
    None and why not."""
    try:
        import tritonclient.http as httpclient
        import tritonclient.utils.cuda_shared_memory as cudashm
    except Exception as e:      # noqa: BLE001 - cuda-python missing, no driver
        return None, f"tritonclient's CUDA shared memory is not usable here: {e}"
    client = httpclient.InferenceServerClient(url, network_timeout=120)
    n = nbytes // 4
    x = np.arange(n, dtype=np.float32)
    hin = cudashm.create_shared_memory_region("bench_in", nbytes, 0)
    hout = cudashm.create_shared_memory_region("bench_out", nbytes, 0)
    try:
        cudashm.set_shared_memory_region(hin, [x])
        # a refusal is the server's failure (it serves CUDA shared memory): it fails the bench
        client.register_cuda_shared_memory("bench_in", cudashm.get_raw_handle(hin), 0, nbytes)
        client.register_cuda_shared_memory("bench_out", cudashm.get_raw_handle(hout), 0, nbytes)
        inp = httpclient.InferInput("INPUT0", [n], "FP32")
        inp.set_shared_memory("bench_in", nbytes)
        out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
        out.set_shared_memory("bench_out", nbytes)
        times = []
        for _ in range(iters + 2):
            t = time.perf_counter()
            client.infer("identity_gpu", [inp], outputs=[out])
            times.append((time.perf_counter() - t) * 1e3)
        got = cudashm.get_contents_as_numpy(hout, np.float32, [n])
        if not np.array_equal(got, x):
            raise SystemExit("the CUDA shared memory identity returned wrong bytes")
        return times[2:], ""
    finally:
        try:
            client.unregister_cuda_shared_memory()
        except Exception:       # noqa: BLE001
            pass
        cudashm.destroy_shared_memory_region(hin)
        cudashm.destroy_shared_memory_region(hout)
        client.close()


# -- the run --------------------------------------------------------------------------------

def run(cpu_dry_run: bool = False, seconds: float = 5.0, concurrency=(1, 16)) -> tuple[str, list[Row]]:
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from serverproc import Server, wait_for

    gpu_on = not cpu_dry_run
    shape = TINY if cpu_dry_run else FULL
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as root:
        repo = write_repository(root, shape, gpu_on)
        with open(os.path.join(root, "params")) as f:
            params = int(f.read())
        model = os.path.join(repo, "convnet", "1", "model.onnx")
        image = shape["image"]
        rng = np.random.default_rng(0)
        x1 = rng.standard_normal((1, 3, image, image), dtype=np.float32)
        xb = rng.standard_normal((MAX_BATCH, 3, image, image), dtype=np.float32)
        device = "CPU (dry run)"
        if gpu_on:
            from shmserve.ipc.gpu import device as gpu
            device = gpu.cuda(0).name()
        title = (f"convnet: {params / 1e6:.1f} M parameters, input [1, 3, {image}, {image}] FP32, "
                 f"on {device}")

        limits = {}
        rate, ms = in_process(model, x1, seconds, gpu_on)
        limits[1] = rate
        rows.append(Row("onnxruntime in process, batch 1", "-", rate, _percentile(ms, 50),
                        _percentile(ms, 99), note="limit for c=1"))
        rate, ms = in_process(model, xb, seconds, gpu_on)
        limits[MAX_BATCH] = rate * MAX_BATCH
        rows.append(Row(f"onnxruntime in process, batch {MAX_BATCH}", "-", rate * MAX_BATCH,
                        _percentile(ms, 50), _percentile(ms, 99),
                        note=f"images/s; limit for c={MAX_BATCH}"))

        srv = Server(repo, "--log-verbose", "0", wait_ready=False, timeout=300)
        try:
            wait_for(lambda: srv.model_ready("convnet") and srv.model_ready("identity_gpu"), 300,
                     "the models to load")
            for c in concurrency:
                rate, ms = through_server(srv.url, x1, c, seconds)
                limit = limits.get(c) or limits[MAX_BATCH if c > 1 else 1]
                rows.append(Row("shmserve HTTP binary", str(c), rate, _percentile(ms, 50),
                                _percentile(ms, 99), rate / limit if limit else None))
            nbytes = IDENTITY_MIB << 20
            if not gpu_on:
                rows.append(Row(f"cudaMemcpy D2D {IDENTITY_MIB} MiB", "1", note="skipped: no GPU"))
                rows.append(Row(f"shmserve identity, CUDA shm {IDENTITY_MIB} MiB", "1",
                                note="skipped: no GPU"))
            else:
                base = d2d_memcpy_ms(nbytes)
                rows.append(Row(f"cudaMemcpy D2D {IDENTITY_MIB} MiB", "1", 1e3 / base, base, base,
                                note="limit"))
                ms, why = cuda_shm_identity(srv.url, nbytes)
                if ms is None:
                    rows.append(Row(f"shmserve identity, CUDA shm {IDENTITY_MIB} MiB", "1",
                                    note=f"skipped: {why}"))
                else:
                    p50 = _percentile(ms, 50)
                    rows.append(Row(f"shmserve identity, CUDA shm {IDENTITY_MIB} MiB", "1",
                                    1e3 / p50, p50, _percentile(ms, 99), base / p50))
        finally:
            srv.stop()
    return title, rows


def table(title: str, rows: list[Row]) -> str:
    def num(v, width, fmt):
        return f"{'-':>{width}}" if v is None else format(v, f"{width}{fmt}")
    lines = [title, "",
             f"{'what':<44} {'conc':>4} {'per s':>9} {'p50 ms':>8} {'p99 ms':>8} {'vs limit':>8}  note",
             "-" * 100]
    for r in rows:
        lines.append(f"{r.what:<44} {r.concurrency:>4} {num(r.per_s, 9, '.1f')} "
                     f"{num(r.p50_ms, 8, '.2f')} {num(r.p99_ms, 8, '.2f')} "
                     f"{num(r.vs_limit, 8, '.2f')}  {r.note}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="tiny network on the CPU provider and KIND_CPU: checks the script without a GPU")
    p.add_argument("--seconds", type=float, default=5.0, help="length of each measurement")
    p.add_argument("--json", help="also write the rows here")
    a = p.parse_args(argv)
    title, rows = run(a.cpu_dry_run, a.seconds)
    print(table(title, rows), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"title": title, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
