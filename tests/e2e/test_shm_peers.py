"""Client shared memory and non-local peers, for real: a network namespace joined to this one by
a veth pair gives a client on another address (IPv4 and IPv6), which runs tritonclient inside
the namespace against a server bound to every address, with two frontends. Under the default
--client-shm-from=local such a client may not register a region, so it must not list, read,
write or unregister the regions local clients registered either, over HTTP or gRPC, whichever
frontend its connection lands on."""
import json
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest
import requests
import tritonclient.utils.shared_memory as shm
from serverproc import Server, wait_for

NS = f"shmpeer{os.getpid()}"
VETH = f"vp{os.getpid()}"                   # + a (this side) / b (the namespace's), <= 15 chars
NET = f"10.213.{os.getpid() % 250}"
NET6 = f"fd00:5eed:{os.getpid() % 65536:x}"
REFUSED = "shared memory is accepted only from clients on this host (--client-shm-from=local)"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


@pytest.fixture(scope="module")
def netns():
    """The namespace, its link to this one up, addresses NET.1 / NET6::1 here and .2 / ::2
    there; removed at the end whatever happened."""
    try:
        _ip("netns", "add", NS)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot create a network namespace (`ip netns add` needs root and "
                    f"CAP_SYS_ADMIN): {getattr(e, 'stderr', '') or e}")
    try:
        for cmd in (["link", "add", f"{VETH}a", "type", "veth", "peer", "name", f"{VETH}b"],
                    ["link", "set", f"{VETH}b", "netns", NS],
                    ["addr", "add", f"{NET}.1/24", "dev", f"{VETH}a"],
                    ["-6", "addr", "add", f"{NET6}::1/64", "dev", f"{VETH}a", "nodad"],
                    ["link", "set", f"{VETH}a", "up"],
                    ["-n", NS, "addr", "add", f"{NET}.2/24", "dev", f"{VETH}b"],
                    ["-n", NS, "-6", "addr", "add", f"{NET6}::2/64", "dev", f"{VETH}b", "nodad"],
                    ["-n", NS, "link", "set", f"{VETH}b", "up"],
                    ["-n", NS, "link", "set", "lo", "up"]):
            _ip(*cmd)
        yield
    finally:
        _ip("link", "del", f"{VETH}a", check=False)
        _ip("netns", "del", NS, check=False)


# Run inside the namespace: every way a client could reach a local client's regions, each
# over a fresh connection several times (two frontends: the connections spread over both).
REMOTE = r"""
import json, queue, sys
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

http_url, grpc_url, key, victim_in, victim_out = sys.argv[1:6]
results = {}

def attempt(what, call):
    try:
        results.setdefault(what, []).append("ok: " + repr(call())[:200])
    except Exception as e:          # tritonclient's InferenceServerException, mostly
        results.setdefault(what, []).append("error: " + str(e))

for proto, mod, url in (("http", httpclient, http_url), ("grpc", grpcclient, grpc_url)):
    for _ in range(3):
        c = mod.InferenceServerClient(url)
        attempt(f"{proto} status", lambda: (c.get_system_shared_memory_status(), c.get_cuda_shared_memory_status()))
        attempt(f"{proto} status one", lambda: c.get_system_shared_memory_status(victim_in))
        x = mod.InferInput("INPUT0", [1, 16], "FP32")
        x.set_shared_memory(victim_in, 64)
        attempt(f"{proto} read", lambda: c.infer("id_fp32", [x]).as_numpy("OUTPUT0").tolist())
        y = mod.InferInput("INPUT0", [1, 16], "FP32")
        y.set_data_from_numpy(np.full((1, 16), 666, np.float32))
        o = mod.InferRequestedOutput("OUTPUT0")
        o.set_shared_memory(victim_out, 64)
        attempt(f"{proto} write", lambda: c.infer("id_fp32", [y], outputs=[o]).get_response())
        attempt(f"{proto} unregister", lambda: c.unregister_system_shared_memory(victim_in))
        attempt(f"{proto} unregister all", lambda: c.unregister_system_shared_memory())
        attempt(f"{proto} register", lambda: c.register_system_shared_memory("mine", key, 64))
        if proto == "grpc":         # a region named on a stream
            answers = queue.Queue()
            c.start_stream(callback=lambda result, error: answers.put((result, error)))
            c.async_stream_infer("id_fp32", [x])
            def streamed():
                result, error = answers.get(timeout=20)
                if error is not None:
                    raise error
                return result.as_numpy("OUTPUT0").tolist()
            attempt("grpc stream read", streamed)
            c.stop_stream()
        c.close()
print(json.dumps(results))
"""


def _ready(base: str) -> bool:
    try:
        return requests.get(f"{base}/v2/health/ready", timeout=2).status_code == 200
    except requests.RequestException:
        return False


@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_a_remote_client_cannot_touch_local_clients_regions(netns, test_repo, family):
    any_host, here = ("0.0.0.0", f"{NET}.1") if family == "ipv4" else ("::", f"[{NET6}::1]")
    # (Server checks readiness over 127.0.0.1, which an IPv6-only socket does not take)
    server = Server(test_repo, "--host", any_host, "--frontends", "2",
                    "--model-control-mode", "explicit", "--load-model", "id_fp32",
                    wait_ready=False)
    local = f"http://127.0.0.1:{server.http_port}" if family == "ipv4" else \
        f"http://[::1]:{server.http_port}"
    wait_for(lambda: _ready(local), 90, "the server to become ready")
    tag = uuid.uuid4().hex[:10]
    victim_in, victim_out = f"in{tag}", f"out{tag}"
    handles = [shm.create_shared_memory_region(n, f"/{n}", 64) for n in (victim_in, victim_out)]
    try:
        shm.set_shared_memory_region(handles[0], [np.arange(16, dtype=np.float32)])
        shm.set_shared_memory_region(handles[1], [np.full(16, 7, np.float32)])
        for n in (victim_in, victim_out):       # registered by a local client
            r = requests.post(f"{local}/v2/systemsharedmemory/region/{n}/register",
                              json={"key": f"/{n}", "offset": 0, "byte_size": 64}, timeout=10)
            assert r.status_code == 200, r.text
        out = subprocess.run(["ip", "netns", "exec", NS, sys.executable, "-c", REMOTE,
                              f"{here}:{server.http_port}", f"{here}:{server.grpc_port}",
                              f"/{victim_in}", victim_in, victim_out],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        results = json.loads(out.stdout)
        assert len(results) == 15
        for what, answers in results.items():
            for answer in answers:
                assert answer.startswith("error: ") and REFUSED in answer, (what, answer)
                assert f"{NET}.2" in answer or f"{NET6}::2" in answer     # says who asked
                if what.split(" ", 1)[1] in ("status", "unregister all", "register"):
                    # it named no region of theirs: it is told of none
                    assert tag not in answer, (what, answer)
        # the local client's regions are as it left them
        status = requests.get(f"{local}/v2/systemsharedmemory/status", timeout=10).json()
        assert sorted(r["name"] for r in status) == sorted([victim_in, victim_out])
        assert shm.get_contents_as_numpy(handles[1], np.float32, [16]).tolist() == [7.0] * 16
        requests.post(f"{local}/v2/systemsharedmemory/unregister", timeout=10)
    finally:
        for h in handles:
            shm.destroy_shared_memory_region(h)
        assert server.stop() == 0
