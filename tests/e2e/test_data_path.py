"""Tensors above the inline limit travel through shared memory, and many clients are served at once."""
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import requests
import tritonclient.http as httpclient

from shmserve.ipc.channel import INLINE_LIMIT


def ipc_metrics(server) -> dict:
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    out = {}
    for m in re.finditer(r'^(shmserve_ipc_\w+)\{direction="(\w+)",process="(\w+)"\} (\S+)$', text, re.M):
        out[(m.group(1), m.group(3), m.group(2))] = float(m.group(4))
    return out


def test_64mib_tensor_does_not_cross_a_socket(server):
    client = httpclient.InferenceServerClient(server.url, network_timeout=120)
    x = np.random.default_rng(0).standard_normal((1, 16 << 20)).astype(np.float32)  # 64 MiB
    inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
    inp.set_data_from_numpy(x)
    res = client.infer("identity_fp32", [inp])
    np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), x)
    m = ipc_metrics(server)
    # every ZeroMQ socket has one end in the frontend or the scheduler: both must have seen traffic,
    # and no message (all frames together) may come near the tensor's size
    assert m[("shmserve_ipc_messages_total", "frontend", "sent")] > 0
    assert m[("shmserve_ipc_messages_total", "scheduler", "received")] > 0
    for (name, proc, direction), value in m.items():
        if name == "shmserve_ipc_largest_message_bytes":
            assert value < 4 * INLINE_LIMIT, (proc, direction, value)


def test_inline_and_shared_memory_sizes_around_the_limit(server):
    client = httpclient.InferenceServerClient(server.url)
    for n in (INLINE_LIMIT // 4 - 1, INLINE_LIMIT // 4, INLINE_LIMIT // 4 + 1, 3 * INLINE_LIMIT):
        x = np.arange(n, dtype=np.float32).reshape(1, n)
        inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_array_equal(client.infer("identity_fp32", [inp]).as_numpy("OUTPUT0"), x)
    # a large JSON (non-binary) input is copied into shared memory by the frontend
    x = np.arange(40000, dtype=np.float32).reshape(1, 40000)
    inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
    inp.set_data_from_numpy(x, binary_data=False)
    np.testing.assert_array_equal(client.infer("identity_fp32", [inp]).as_numpy("OUTPUT0"), x)
    big = np.array([b"x" * 100000, b"y" * 5], dtype=object)
    inp = httpclient.InferInput("INPUT0", [1, 2], "BYTES")
    inp.set_data_from_numpy(big.reshape(1, 2))
    got = client.infer("id_bytes", [inp]).as_numpy("OUTPUT0")
    assert list(got.reshape(-1)) == list(big)


def _one(url: str, i: int):
    c = httpclient.InferenceServerClient(url)
    try:
        x = np.full((1, 8), i, dtype=np.float32)
        inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
        inp.set_data_from_numpy(x)
        res = c.infer("pid_slow", [inp], parameters={"delay_ms": 20})
        return i, res.as_numpy("OUTPUT0"), int(res.as_numpy("PID")[0, 0])
    finally:
        c.close()


def test_64_concurrent_requests_over_two_instances(server):
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda i: _one(server.url, i), range(64)))
    pids = set()
    for i, out, pid in results:
        np.testing.assert_array_equal(out, np.full((1, 8), i, dtype=np.float32))
        pids.add(pid)
    assert len(pids) == 2, pids


def test_concurrent_mixed_sizes_keep_answers_apart(server):
    """Slots are reused under load: every answer must carry its own request's data."""
    def run(i):
        c = httpclient.InferenceServerClient(server.url)
        try:
            n = 20000 + 997 * i   # above the inline limit, every size different
            x = (np.arange(n, dtype=np.float32) + i).reshape(1, n)
            inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
            inp.set_data_from_numpy(x)
            got = c.infer("identity_fp32", [inp]).as_numpy("OUTPUT0")
            return np.array_equal(got, x)
        finally:
            c.close()
    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(run, range(48)))


def test_chunked_and_compressed_large_bodies_use_shared_memory(server):
    import gzip
    import json as _json
    x = np.arange(1 << 18, dtype=np.float32)             # 1 MiB binary input
    header = _json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, x.size], "datatype": "FP32",
                                      "parameters": {"binary_data_size": x.nbytes}}],
                          "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}).encode()
    body = header + x.tobytes()
    headers = {"Inference-Header-Content-Length": str(len(header))}

    def chunks():
        for i in range(0, len(body), 100000):
            yield body[i:i + 100000]

    for data, extra in ((chunks(), {}), (gzip.compress(body), {"Content-Encoding": "gzip"})):
        r = requests.post(f"{server.base}/v2/models/identity_fp32/infer", data=data,
                          headers={**headers, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        hlen = int(r.headers["Inference-Header-Content-Length"])
        np.testing.assert_array_equal(np.frombuffer(r.content[hlen:], dtype=np.float32), x)
    for (name, proc, direction), value in ipc_metrics(server).items():
        if name == "shmserve_ipc_largest_message_bytes":
            assert value < 4 * INLINE_LIMIT, (proc, direction, value)
