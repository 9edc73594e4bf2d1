"""Bad requests get a clear 4xx that names the problem, and the server keeps serving."""
import json

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from serverproc import frontend_pids, peak_rss, peak_rss_reset


def _post(server, path, body=b"", headers=None):
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    return requests.post(f"{server.base}{path}", data=body, headers=headers or {}, timeout=30)


def _in(name="INPUT0", shape=(1, 4), datatype="FP32", data=None, **params):
    t = {"name": name, "shape": list(shape), "datatype": datatype}
    if data is not None:
        t["data"] = data
    if params:
        t["parameters"] = params
    return t


GOOD = {"inputs": [_in(data=[1.0, 2.0, 3.0, 4.0])]}

CASES = [
    # (id, path, body, headers, status, text expected in the error)
    ("unknown model", "/v2/models/nope/infer", GOOD, None, 404, "unknown model: 'nope'"),
    ("unknown version", "/v2/models/identity_fp32/versions/9/infer", GOOD, None, 404, "version 9"),
    ("non-numeric version", "/v2/models/identity_fp32/versions/abc/infer", GOOD, None, 404, "Not Found"),
    ("wrong shape", "/v2/models/simple/infer",
     {"inputs": [_in("INPUT0", (1, 8), "INT32", [0] * 8), _in("INPUT1", (1, 16), "INT32", [0] * 16)]},
     None, 400, "unexpected shape for input 'INPUT0'"),
    ("wrong datatype", "/v2/models/identity_fp32/infer",
     {"inputs": [_in(datatype="FP64", data=[1.0, 2.0, 3.0, 4.0])]}, None, 400, "data-type is 'FP64'"),
    ("missing input", "/v2/models/simple/infer",
     {"inputs": [_in("INPUT0", (1, 16), "INT32", [0] * 16)]}, None, 400, "missing required input(s) ['INPUT1']"),
    ("input given twice", "/v2/models/identity_fp32/infer",
     {"inputs": [_in(data=[1.0] * 4), _in(data=[2.0] * 4)]}, None, 400, "input 'INPUT0' already exists in request"),
    ("unknown input", "/v2/models/identity_fp32/infer",
     {"inputs": [_in("INPUTX", data=[1.0] * 4)]}, None, 400, "unexpected inference input 'INPUTX'"),
    ("malformed JSON", "/v2/models/identity_fp32/infer", b'{"inputs": [', None, 400, "JSON"),
    ("JSON not an object", "/v2/models/identity_fp32/infer", b'[1, 2]', None, 400, "object"),
    ("element count", "/v2/models/identity_fp32/infer",
     {"inputs": [_in(data=[1.0, 2.0])]}, None, 400,
     "Failed to parse 'data' field: shape does not match true shape"),
    ("string in numeric tensor", "/v2/models/identity_fp32/infer",
     {"inputs": [_in(data=["a", 2.0, 3.0, 4.0])]}, None, 400, "must hold numbers"),
    ("data and binary both", "/v2/models/identity_fp32/infer",
     {"inputs": [_in(data=[1.0] * 4, binary_data_size=16)]}, None, 400, "only one of"),
    ("neither data nor binary", "/v2/models/identity_fp32/infer",
     {"inputs": [_in()]}, None, 400, "only one of"),
    ("bad datatype name", "/v2/models/identity_fp32/infer",
     {"inputs": [_in(datatype="FLOAT", data=[1.0] * 4)]}, None, 400, "invalid datatype for input INPUT0"),
    ("negative dim", "/v2/models/identity_fp32/infer",
     {"inputs": [_in(shape=(1, -4), data=[1.0] * 4)]}, None, 500, "'shape'"),     # as Triton
    ("batch too large", "/v2/models/simple/infer",
     {"inputs": [_in("INPUT0", (9, 16), "INT32", [0] * 144), _in("INPUT1", (9, 16), "INT32", [0] * 144)]},
     None, 400, "batch-size must be <= 8"),
    ("unknown output", "/v2/models/identity_fp32/infer",
     {"inputs": GOOD["inputs"], "outputs": [{"name": "NOPE"}]}, None, 400, "unexpected inference output 'NOPE'"),
    ("reserved parameter", "/v2/models/identity_fp32/infer",
     {"inputs": GOOD["inputs"], "parameters": {"triton_x": 1}}, None, 400, "reserved"),
    ("header length beyond body", "/v2/models/identity_fp32/infer", json.dumps(GOOD).encode(),
     {"Inference-Header-Content-Length": "100000"}, 400, "Inference-Header-Content-Length"),
    ("header length not a number", "/v2/models/identity_fp32/infer", json.dumps(GOOD).encode(),
     {"Inference-Header-Content-Length": "ten"}, 400, "Inference-Header-Content-Length"),
    ("raw body on a two-input model", "/v2/models/simple/infer", b"\0" * 128,
     {"Inference-Header-Content-Length": "0"}, 400, "Raw request must only have 1 input (found 1)"),
    ("raw body of the wrong size", "/v2/models/nobatch_fp32/infer", b"\0" * 6,
     {"Inference-Header-Content-Length": "0"}, 400, "do not fit"),
    # these were 500s (issue 13): recursion in the JSON decoder, ints past 64 bits on the wire
    ("JSON nested 5,000 deep", "/v2/models/identity_fp32/infer",
     b'{"inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}", None, 400, "nested too deeply"),
    ("priority past 64 bits", "/v2/models/identity_fp32/infer",
     {"inputs": GOOD["inputs"], "parameters": {"priority": 2 ** 70}}, None, 400,
     "'priority' must be an unsigned 64-bit integer"),
    ("timeout past 64 bits", "/v2/models/identity_fp32/infer",
     {"inputs": GOOD["inputs"], "parameters": {"timeout": 2 ** 64}}, None, 400,
     "'timeout' must be an unsigned 64-bit integer"),
    ("custom parameter past 64 bits", "/v2/models/identity_fp32/infer",
     {"inputs": GOOD["inputs"], "parameters": {"x": -2 ** 63 - 1}}, None, 400,
     "'x' is out of the 64-bit integer range"),
    ("custom parameter not a scalar", "/v2/models/identity_fp32/infer",
     {"inputs": GOOD["inputs"], "parameters": {"x": {"y": 1}}}, None, 400,
     "'x' must be a string, boolean, integer or number"),
]


def test_stats_of_a_version_past_64_bits_is_a_400(server):
    """It was a 500 from the scheduler message that could not carry the number."""
    r = requests.get(f"{server.base}/v2/models/identity_fp32/versions/{2 ** 64}/stats", timeout=30)
    assert r.status_code == 400 and r.json()["error"] == \
        f"failed to get model version from specified version string '{2 ** 64}' (details: stol), " \
        f"version should be an integral value > 0"


def test_body_past_the_limit_is_a_413_that_names_it(server):
    """It was a 400 "User callback error": httptools wraps what its callbacks raise."""
    body = b"{" + b" " * ((64 << 20) + 10) + b"}"
    r = requests.post(f"{server.base}/v2/repository/index", data=body, timeout=60)
    assert r.status_code == 413
    assert "request JSON size of 67108876 bytes exceeds the maximum allowed input size of " \
        "67108864 bytes" in r.json()["error"]
    assert requests.get(f"{server.base}/v2/health/ready", timeout=30).status_code == 200


def _binary_body(header: dict, payload: bytes):
    h = json.dumps(header).encode()
    return h + payload, {"Inference-Header-Content-Length": str(len(h))}


def test_truncated_binary_body(server):
    body, headers = _binary_body({"inputs": [_in(binary_data_size=16)]}, b"\0" * 10)
    r = _post(server, "/v2/models/identity_fp32/infer", body, headers)
    assert r.status_code == 400
    assert "unexpected size for input 'INPUT0'" in r.json()["error"]


def test_extra_binary_data(server):
    body, headers = _binary_body({"inputs": [_in(binary_data_size=16)]}, b"\0" * 20)
    r = _post(server, "/v2/models/identity_fp32/infer", body, headers)
    assert r.status_code == 400 and "unexpected additional input data" in r.json()["error"]


def test_binary_size_mismatch(server):
    body, headers = _binary_body({"inputs": [_in(binary_data_size=12)]}, b"\0" * 12)
    r = _post(server, "/v2/models/identity_fp32/infer", body, headers)
    assert r.status_code == 400 and "Expected 16, got 12" in r.json()["error"]


def test_truncated_bytes_tensor(server):
    bad = (5).to_bytes(4, "little") + b"abc"
    body, headers = _binary_body({"inputs": [_in(shape=(1, 1), datatype="BYTES",
                                                 binary_data_size=len(bad))]}, bad)
    r = _post(server, "/v2/models/id_bytes/infer", body, headers)
    assert r.status_code == 400 and r.json()["error"] == \
        "incomplete string data for inference input 'INPUT0', expecting string of length 5 but " \
        "only 3 bytes available"


def test_large_truncated_body_into_shared_memory(server):
    """A big body that lies about its binary size fails cleanly and frees its slot."""
    payload = b"\0" * (1 << 20)
    body, headers = _binary_body({"inputs": [_in(shape=(1, 300000), binary_data_size=1200000)]}, payload)
    r = _post(server, "/v2/models/identity_fp32/infer", body, headers)
    assert r.status_code == 400 and "unexpected size" in r.json()["error"]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request(server, case):
    _, path, body, headers, status, text = case
    r = _post(server, path, body, headers)
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"] == "application/json"
    assert text in r.json()["error"]


def test_routing_errors(server):
    assert requests.get(f"{server.base}/v2/nothing/here", timeout=10).status_code == 404
    assert requests.get(f"{server.base}/v2/nothing/here", timeout=10).json() == {"error": "Not Found"}
    assert requests.get(f"{server.base}/v2/models/simple/infer", timeout=10).status_code == 405
    assert requests.post(f"{server.base}/v2/health/live", timeout=10).status_code == 405
    assert requests.delete(f"{server.base}/v2/models/simple", timeout=10).status_code == 405
    assert requests.get(f"{server.base}/v2/models/simple/config/extra", timeout=10).status_code == 404


def test_server_still_serves_after_bad_requests(server):
    c = httpclient.InferenceServerClient(server.url)
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    i = httpclient.InferInput("INPUT0", x.shape, "FP32")
    i.set_data_from_numpy(x)
    np.testing.assert_array_equal(c.infer("identity_fp32", [i]).as_numpy("OUTPUT0"), x)
    assert c.is_server_ready()


def test_malformed_http_is_answered_and_closed(server):
    import socket
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        data = s.recv(4096)
    assert data.startswith(b"HTTP/1.1 400")
    assert server.ready()


def test_repository_index_lists_every_version(server):
    r = requests.post(f"{server.base}/v2/repository/index", timeout=10)
    assert r.status_code == 200
    entries = {e["name"]: e for e in r.json()}
    assert entries["simple"] == {"name": "simple", "version": "1", "state": "READY"}     # as Triton
    r = requests.post(f"{server.base}/v2/repository/index", json={"ready": "yes"}, timeout=10)
    assert r.status_code == 400


def test_gzip_bomb_and_truncated_gzip_are_refused(server):
    """1 MB of gzip that inflates past 1 GiB was inflated up to 1 GiB on the event loop (the
    frontend grew by more than that); a truncated stream passed as a shorter body. A compressed
    body may now inflate to --http-max-input-size (64 MiB here) and no further."""
    import gzip
    import zlib
    z = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zero = b"\0" * (1 << 20)
    bomb = b"".join(z.compress(zero) for _ in range((1 << 10) + 1)) + z.flush()
    assert len(bomb) < 2 << 20
    (frontend,) = frontend_pids(server)
    peak_rss_reset(frontend)
    before = peak_rss(frontend)
    r = requests.post(f"{server.base}/v2/models/identity_fp32/infer", data=bomb,
                      headers={"Content-Encoding": "gzip"}, timeout=120)
    assert r.status_code == 400 and "Decompressed data size exceeds the maximum allowed value of " \
        "67108864 bytes" in r.json()["error"]
    assert "--http-max-input-size" in r.json()["error"]
    grown = peak_rss(frontend) - before
    assert grown < 256 << 20, f"the frontend's peak RSS grew by {grown >> 20} MiB"
    good = gzip.compress(json.dumps(GOOD).encode())
    r = requests.post(f"{server.base}/v2/models/identity_fp32/infer", data=good[:-12],
                      headers={"Content-Encoding": "gzip"}, timeout=30)
    assert r.status_code == 400 and "truncated" in r.json()["error"]
    r = requests.post(f"{server.base}/v2/models/identity_fp32/infer", data=b"\x1f\x8bnot gzip",
                      headers={"Content-Encoding": "gzip"}, timeout=30)
    assert r.status_code == 400 and "failed to decompress the gzip request body" in r.json()["error"]
    r = requests.post(f"{server.base}/v2/models/identity_fp32/infer", data=good,
                      headers={"Content-Encoding": "gzip"}, timeout=30)
    assert r.status_code == 200
