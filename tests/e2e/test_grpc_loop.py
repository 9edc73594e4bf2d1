"""The gRPC server on the frontend's event loop (frontend/grpc/loop.py, the default), end to end
with grpcio and tritonclient: large messages both ways through HTTP/2 flow control, compressed
requests, many calls on one connection, what is not gRPC, and the grpc.aio server beside it."""
import asyncio
import socket

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from serverproc import Server, wait_for
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException


def _identity(client, values: np.ndarray, **kw):
    x = grpcclient.InferInput("INPUT0", list(values.shape), "FP32")
    x.set_data_from_numpy(values)
    return client.infer("identity_fp32", [x], **kw).as_numpy("OUTPUT0")


def test_large_tensors_cross_both_windows(server):
    values = np.random.default_rng(1).random((1, 3 << 20), dtype=np.float32)   # 12 MiB
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        for _ in range(3):
            np.testing.assert_array_equal(_identity(c, values), values)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests(server, algorithm):
    values = np.arange(4096, dtype=np.float32).reshape(1, -1)
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        got = _identity(c, values, compression_algorithm=algorithm)
    np.testing.assert_array_equal(got, values)


def test_many_calls_on_one_connection_keep_their_answers(server):
    async def run():
        async with aioclient.InferenceServerClient(server.grpc_url) as c:
            async def one(i):
                x = aioclient.InferInput("INPUT0", [1, 8], "FP32")
                x.set_data_from_numpy(np.full((1, 8), i, dtype=np.float32))
                r = await c.infer("identity_fp32", [x], request_id=str(i))
                return r.get_response().id, r.as_numpy("OUTPUT0")[0, 0]
            return await asyncio.gather(*(one(i) for i in range(200)))
    for rid, value in asyncio.run(run()):
        assert float(rid) == value


def test_an_unknown_method_is_unimplemented(server):
    with grpc.insecure_channel(server.grpc_url) as ch:
        call = ch.unary_unary("/inference.GRPCInferenceService/NoSuchMethod",
                              request_serializer=service_pb2.ServerLiveRequest.SerializeToString,
                              response_deserializer=service_pb2.ServerLiveResponse.FromString)
        with pytest.raises(grpc.RpcError) as e:
            call(service_pb2.ServerLiveRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert e.value.details() == "Method not found!"


def _closed_by_server(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        got = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return got
            got += chunk


@pytest.mark.parametrize("garbage", [
    b"GET /v2 HTTP/1.1\r\nHost: x\r\n\r\n",
    # a SETTINGS frame whose length is not a multiple of six
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x05\x04\x00\x00\x00\x00\x00" + bytes(5),
])
def test_what_is_not_grpc_closes_its_connection_and_nothing_else(server, garbage):
    got = _closed_by_server(server.grpc_port, garbage)
    if garbage.startswith(b"PRI"):         # the server's SETTINGS, then GOAWAY FRAME_SIZE_ERROR
        assert b"\x07\x00\x00\x00\x00\x00" in got and b"\x00\x00\x00\x06" in got
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        assert c.is_server_live()


def test_a_client_gone_in_the_middle_costs_nothing(server):
    """Half a request, then the socket closes: the server forgets it and keeps serving."""
    import h2.config
    import h2.connection
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":authority", "x"),
                          (":path", "/inference.GRPCInferenceService/ModelInfer"),
                          ("content-type", "application/grpc"), ("te", "trailers")])
    conn.send_data(1, b"\x00\x00\x00\x10\x00" + b"\x0a")       # 1 byte of a 4096-byte message
    with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=10) as s:
        s.sendall(conn.data_to_send())
        s.recv(65536)                                           # the server's SETTINGS
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        values = np.ones((1, 4), dtype=np.float32)
        np.testing.assert_array_equal(_identity(c, values), values)


def test_a_request_past_the_message_limit(example_repo):
    srv = Server([example_repo], "--grpc-max-message-size", "2000")
    try:
        with grpcclient.InferenceServerClient(srv.grpc_url) as c:
            with pytest.raises(InferenceServerException) as e:
                _identity(c, np.ones((1, 1000), dtype=np.float32))
            assert "RESOURCE_EXHAUSTED" in str(e.value.status())
            assert "larger than max" in e.value.message()
            values = np.ones((1, 4), dtype=np.float32)
            np.testing.assert_array_equal(_identity(c, values), values)
    finally:
        assert srv.stop() == 0


def test_the_grpc_aio_server_is_still_there(example_repo):
    srv = Server([example_repo], "--grpc-server", "aio", "--log-verbose", "1")
    try:
        with grpcclient.InferenceServerClient(srv.grpc_url) as c:
            values = np.arange(16, dtype=np.float32).reshape(1, -1)
            np.testing.assert_array_equal(_identity(c, values), values)
    finally:
        assert srv.stop() == 0


def test_a_flag_the_loop_server_lacks_is_served_by_grpc_aio_and_says_so(example_repo):
    srv = Server([example_repo], "--grpc-infer-response-compression-level", "high")
    try:
        wait_for(lambda: "served by grpc.aio" in srv.log_text(), 30, "the log line")
        assert "grpc.default_compression_level" in srv.log_text()
        with grpcclient.InferenceServerClient(srv.grpc_url) as c:
            assert c.is_server_ready()
    finally:
        assert srv.stop() == 0


class RawClient:
    """An HTTP/2 client (h2) on a plain socket, to see the frames the server sends."""

    def __init__(self, port: int):
        import h2.config
        import h2.connection
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(self.conn.data_to_send())
        self.events: list = []
        self.closed = False

    def read_until(self, done, timeout: float, answer: bool = True) -> None:
        """Reads (answering PINGs unless ``answer`` is false) until ``done()`` or the socket
        closes; fails past ``timeout``."""
        import time
        deadline = time.monotonic() + timeout
        while not done() and not self.closed:
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; events so far: {self.events}"
            self.sock.settimeout(left)
            data = self.sock.recv(65536)
            if not data:
                self.closed = True
                break
            self.events += self.conn.receive_data(data)
            out = self.conn.data_to_send()
            if out and answer:
                self.sock.sendall(out)

    def count(self, kind) -> int:
        return sum(isinstance(e, kind) for e in self.events)


def test_keepalive_pings_and_the_watchdog(example_repo):
    import h2.events
    srv = Server([example_repo], "--grpc-keepalive-time", "200", "--grpc-keepalive-timeout",
                 "500", "--grpc-keepalive-permit-without-calls", "true")
    try:
        assert "served by grpc.aio" not in srv.log_text()
        answering = RawClient(srv.grpc_port)
        answering.read_until(lambda: answering.count(h2.events.PingReceived) >= 3, 30)
        assert not answering.closed             # answered pings keep it open
        silent = RawClient(srv.grpc_port)
        silent.read_until(lambda: False, 30, answer=False)
        assert silent.closed and silent.count(h2.events.PingReceived) >= 1
        assert silent.count(h2.events.ConnectionTerminated) == 1
        with grpcclient.InferenceServerClient(srv.grpc_url) as c:
            values = np.ones((1, 4), dtype=np.float32)
            np.testing.assert_array_equal(_identity(c, values), values)
        answering.sock.close()
    finally:
        assert srv.stop() == 0


def test_connections_are_aged_out_with_goaway_then_closed(example_repo):
    import h2.events
    srv = Server([example_repo], "--grpc-max-connection-age", "300",
                 "--grpc-max-connection-age-grace", "300")
    try:
        client = RawClient(srv.grpc_port)
        client.read_until(lambda: False, 30)
        assert client.closed and client.count(h2.events.ConnectionTerminated) == 1
        with grpcclient.InferenceServerClient(srv.grpc_url) as c:   # a new one is served
            assert c.is_server_live()
    finally:
        assert srv.stop() == 0


def test_a_stream_client_that_stops_reading_is_held_then_loses_nothing(server):
    """ModelStreamInfer with 64 KiB requests and answers from a client that reads no answer:
    the server stops reading the stream (its window stays shut) long before all are sent;
    once the client reads again every answer arrives, in order."""
    import h2.events
    from tritonclient.grpc import service_pb2 as pb

    from shmserve.frontend.grpc.call import MessageReader, frame
    from shmserve.frontend.grpc.loop import STREAM_WINDOW

    values = np.arange(16384, dtype=np.float32)
    total = 300                                              # 19 MiB of requests
    messages = [frame(pb.ModelInferRequest(
        model_name="identity_fp32", id=str(i),
        inputs=[pb.ModelInferRequest.InferInputTensor(name="INPUT0", datatype="FP32",
                                                      shape=[1, 16384])],
        raw_input_contents=[values.tobytes()]).SerializeToString()) for i in range(total)]
    size = len(messages[0])
    client = RawClient(server.grpc_port)
    client.read_until(lambda: client.count(h2.events.RemoteSettingsChanged) >= 1, 30)
    conn, sid = client.conn, 1
    conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":authority", "x"),
                            (":path", "/inference.GRPCInferenceService/ModelStreamInfer"),
                            ("content-type", "application/grpc"), ("te", "trailers")])
    client.sock.sendall(conn.data_to_send())

    def send_what_fits(sent: int) -> int:
        while sent < total and conn.local_flow_control_window(sid) >= size:
            step = conn.max_outbound_frame_size         # the server's SETTINGS_MAX_FRAME_SIZE
            for i in range(0, size, step):
                conn.send_data(sid, messages[sent][i:i + step])
            client.sock.sendall(conn.data_to_send())
            sent += 1
        return sent

    sent = send_what_fits(0)
    while sent < total:                 # read window updates (never acknowledging answers)
        client.sock.settimeout(1.0)
        try:
            data = client.sock.recv(1 << 20)
        except TimeoutError:
            break                       # the window stayed shut
        client.events += conn.receive_data(data)
        sent = send_what_fits(sent)
    # what the server took: its window, what 16 requests in flight freed, one answer's room
    assert sent * size <= STREAM_WINDOW + 20 * size, sent
    assert sent < total

    reader, answers = MessageReader(1 << 30, b""), []
    client.sock.settimeout(30)
    pending = client.events                     # what arrived while the client did not read
    ended = False
    while len(answers) < total:
        if not pending:
            data = client.sock.recv(1 << 20)
            assert data, "the server closed the connection"
            pending = conn.receive_data(data)
        events, pending = pending, []
        for event in events:
            if isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, sid)
                answers += [pb.ModelStreamInferResponse.FromString(m)
                            for m in reader.feed(event.data)]
        sent = send_what_fits(sent)
        if sent == total and not ended:
            conn.end_stream(sid)
            ended = True
        client.sock.sendall(conn.data_to_send())
    assert [a.infer_response.id for a in answers] == [str(i) for i in range(total)]
    assert all(a.error_message == "" for a in answers)
    np.testing.assert_array_equal(np.frombuffer(answers[-1].infer_response.raw_output_contents[0],
                                                dtype=np.float32), values)
    client.sock.close()


def _raw_infer_call(port: int, *messages: bytes) -> dict:
    """One ModelInfer call sent frame by frame: the given gRPC messages, then the end of the
    stream; returns the call's trailers (grpc-status, grpc-message)."""
    import h2.events
    c = RawClient(port)
    c.conn.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":authority", "x"),
                            (":path", "/inference.GRPCInferenceService/ModelInfer"),
                            ("content-type", "application/grpc"), ("te", "trailers")])
    for m in messages:
        c.conn.send_data(1, b"\x00" + len(m).to_bytes(4, "big") + m)
    c.conn.end_stream(1)
    c.sock.sendall(c.conn.data_to_send())
    c.read_until(lambda: c.count(h2.events.StreamEnded), 30)
    c.sock.close()
    blocks = [e.headers for e in c.events
              if isinstance(e, (h2.events.TrailersReceived, h2.events.ResponseReceived))]
    return {k.decode(): v.decode() for k, v in blocks[-1]}


@pytest.mark.parametrize("kind", ["loop", "aio"])
def test_a_unary_call_that_is_not_one_request(example_repo, kind):
    """Two request messages on a ModelInfer call: answered from the first, as gRPC's own
    servers do; bytes that are no ModelInferRequest: an error status, the model never asked.
    The server goes on serving either way."""
    srv = Server([example_repo], "--grpc-server", kind)
    try:
        request = service_pb2.ModelInferRequest(model_name="identity_fp32")
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
        request.raw_input_contents.append(np.ones(4, np.float32).tobytes())
        one = request.SerializeToString()
        trailers = _raw_infer_call(srv.grpc_port, one, one)
        assert trailers["grpc-status"] == "0", trailers
        trailers = _raw_infer_call(srv.grpc_port, b"\xff\xff\xff")
        assert trailers["grpc-status"] == str(grpc.StatusCode.UNKNOWN.value[0]), trailers
        assert "Error parsing message" in trailers["grpc-message"]
        with grpcclient.InferenceServerClient(srv.grpc_url) as c:
            values = np.ones((1, 4), dtype=np.float32)
            np.testing.assert_array_equal(_identity(c, values), values)
            stats = c.get_inference_statistics("identity_fp32", as_json=True)
            assert int(stats["model_stats"][0]["inference_stats"]["success"]["count"]) == 2
    finally:
        assert srv.stop() == 0
