"""The HTTP/2 DoS advisories against the gRPC port, scaled to a test: ping, settings, reset,
empty-frame, priority and CONTINUATION floods (CVE-2019-9512..9518, CVE-2024-27316), rapid
reset (CVE-2023-44487). Each flood is cut off with GOAWAY ENHANCE_YOUR_CALM once past its
budget (1,000 frames at once), and the server goes on serving everyone else."""
import struct

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from h2frames import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    HEADERS,
    IDENTITY_CONFIG,
    INFER,
    INITIAL_WINDOW_SIZE,
    PRIORITY,
    Conn,
    frame,
    ping,
    request,
    rst,
    settings,
)
from repo_builder import IDENTITY, write_model
from serverproc import Server, wait_for

MODEL = IDENTITY_CONFIG
N = 1100                # past every budget's burst of 1,000


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("h2floods"))
    write_model(repo, "identity", MODEL, IDENTITY)
    s = Server([repo])
    yield s
    assert s.stop() == 0


def _infer_body(model: str = "identity") -> bytes:
    from tritonclient.grpc import service_pb2
    req = service_pb2.ModelInferRequest(model_name=model)
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[1])
    req.raw_input_contents.append(b"\x00" * 4)
    body = req.SerializeToString()
    return b"\x00" + len(body).to_bytes(4, "big") + body


def _serves(srv) -> None:
    with grpcclient.InferenceServerClient(srv.grpc_url) as c:
        x = grpcclient.InferInput("INPUT0", [2], "FP32")
        x.set_data_from_numpy(np.ones(2, np.float32))
        np.testing.assert_array_equal(c.infer("identity", [x]).as_numpy("OUTPUT0"), np.ones(2))


def _executions(srv) -> int:
    stats = requests.get(f"{srv.base}/v2/models/identity/stats", timeout=10).json()
    return int(stats["model_stats"][0]["inference_count"])


FLOODS = {
    "ping (CVE-2019-9512)": lambda c: ping() * N,
    "settings (CVE-2019-9515)": lambda c: settings((INITIAL_WINDOW_SIZE, 65535)) * N,
    "one SETTINGS of 2,730 entries": lambda c: settings(*[(INITIAL_WINDOW_SIZE, 100 + i) for i in range(2730)]),
    "priority (CVE-2019-9513)": lambda c: frame(PRIORITY, 0, 1, b"\x00\x00\x00\x00\x10") * N,
    "empty DATA (CVE-2019-9518)": lambda c: c.headers(1, request(INFER)) + frame(DATA, 0, 1) * N,
    "empty CONTINUATION (CVE-2024-27316)": lambda c: frame(HEADERS, 0, 1, c.block(request(INFER)))
    + frame(CONTINUATION, 0, 1) * 20,
    "CONTINUATION without end": lambda c: frame(HEADERS, 0, 1, c.block(request(INFER)))
    + frame(CONTINUATION, 0, 1, b"\x82" * 1000) * 20,
    "streams the server resets (CVE-2019-9514)": lambda c: b"".join(
        c.headers(sid, request(INFER, **{"x-Bad": "1"}), END_HEADERS | END_STREAM) for sid in range(1, 2 * N, 2)),
    "rapid reset (CVE-2023-44487)": lambda c: b"".join(
        c.headers(sid, request(INFER)) + rst(sid) for sid in range(1, 2 * N, 2)),
    "resets of closed streams": lambda c: c.headers(1, request(INFER)) + rst(1) * N,
    "streams past the concurrency limit": lambda c: b"".join(
        c.headers(sid, request(INFER)) for sid in range(1, 2 * (256 + N), 2)),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flood", list(FLOODS), ids=list(FLOODS))
def test_a_flood_is_cut_off_and_others_are_served(srv, flood):
    c = Conn(srv.grpc_port)
    c.send(FLOODS[flood](c))            # all at once, reading nothing meanwhile
    c.goaway(ENHANCE_YOUR_CALM)
    c.close()
    _serves(srv)


@pytest.mark.timeout(60)
def test_calls_reset_in_the_read_that_brought_them_never_reach_the_model(srv):
    """Rapid reset's other half: a call whose request and reset arrive together is dropped
    before it is sent anywhere (before, most of them still ran the model)."""
    _serves(srv)
    before = _executions(srv)
    c = Conn(srv.grpc_port)
    body = _infer_body()
    calls = [c.headers(sid, request(INFER)) + frame(DATA, END_STREAM, sid, body) + rst(sid)
             for sid in range(1, 41, 2)]
    c.send(b"".join(calls))
    c.alive()
    c.close()
    _serves(srv)            # one more execution, after any of the reset ones
    wait_for(lambda: _executions(srv) >= before + 1, 10, "the last call's statistics")
    assert _executions(srv) == before + 1


def test_a_settings_frame_changes_every_stream_once(srv):
    """With streams open, a SETTINGS frame of 32 INITIAL_WINDOW_SIZE entries (the most one
    frame may hold) leaves the last value, applied once, and the calls go on."""
    c = Conn(srv.grpc_port)
    c.send(b"".join(c.headers(sid, request(INFER)) for sid in range(1, 201, 2)))
    c.send(settings(*[(INITIAL_WINDOW_SIZE, 1000 + i) for i in range(32)]))
    c.alive()
    body = _infer_body()
    c.send(frame(DATA, END_STREAM, 1, body))
    got = c.answer(1)
    assert got["headers"][-1].get(b"grpc-status", got["headers"][-1].get("grpc-status")) in (b"0", "0"), got
    assert all(len(f.data) <= 1031 for f in c.frames if f.type == DATA)
    c.close()


def test_a_frame_header_alone_is_held_as_what_it_is(srv):
    """A frame announced but never sent whole is at most 16 KiB (SETTINGS_MAX_FRAME_SIZE at its
    default): the advertised limit, not 16 MiB."""
    c = Conn(srv.grpc_port)
    assert c.server_settings.get(5, 16384) == 16384
    c.send(struct.pack(">I", 16385)[1:] + bytes((DATA, 0)) + struct.pack(">I", 1))
    c.goaway(6)         # FRAME_SIZE_ERROR, at once: the payload is not waited for
    c.close()


def test_a_read_of_many_large_header_blocks_is_served_over_several_turns(srv):
    """The core stops decoding after 32 KiB of header blocks in one read and the connection
    takes the rest on later turns of the loop (reading nothing meanwhile): every call of the
    read is still answered, in full."""
    c = Conn(srv.grpc_port)
    try:
        sids = list(range(1, 81, 2))
        c.send(b"".join(c.headers(sid, request(x_pad="%05d" % sid + "p" * 2000))
                        + frame(DATA, END_STREAM, sid, b"\x00\x00\x00\x00\x00") for sid in sids))
        for sid in sids:
            trailers = c.answer(sid)["headers"][-1]
            assert trailers["grpc-status"] == "0", trailers
        c.alive()
    finally:
        c.close()
    _serves(srv)
