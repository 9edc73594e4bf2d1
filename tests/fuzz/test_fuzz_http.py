"""The HTTP request parser and the HTTP/JSON infer codec under arbitrary input."""
import json
import re

from hypothesis import event, given
from hypothesis import strategies as st
from strategies import datatypes, json_values, names, params, shapes
from test_http_codec import CONFIGS, _info

from shmserve.engine.requests import prepare as request
from shmserve.engine.requests.catalog import ModelCatalog
from shmserve.frontend.http import codec as http_codec
from shmserve.frontend.http.server import HttpApp, HttpConnection
from shmserve.frontend.shm.registry import ShmRegistry
from shmserve.ipc import shm
from shmserve.ipc.errors import InferError
from shmserve.ipc.messages.to_frontend import ModelTable

CATALOG = ModelCatalog()
CATALOG.update(ModelTable([_info(n, t) for n, t in CONFIGS.items()], startup_done=True))
PREFIX = shm.new_server_prefix()
ARENA = shm.ShmArena(PREFIX, chunk_size=2 << 20)

tensor = st.fixed_dictionaries({"name": names, "datatype": datatypes, "shape": shapes},
                               optional={"data": json_values, "parameters": params})
infer_doc = st.fixed_dictionaries({"inputs": st.one_of(st.lists(tensor, max_size=4), json_values)},
                                  optional={"outputs": st.lists(st.fixed_dictionaries(
                                      {"name": names}, optional={"parameters": params}),
                                      max_size=3),
                                      "parameters": params, "id": json_values})


def teardown_module():
    ARENA.close()
    shm.unlink_prefixed(PREFIX)


def _parse(model, body: bytes, header_len):
    try:
        prepared = http_codec.parse_infer(CATALOG.get(model), body, header_len, None, ARENA,
                                          ShmRegistry())
    except InferError as e:
        assert e.message
        event(f"refused: {e.message.split(':')[0][:40]}")
        return
    event("accepted")
    request.release(prepared, ARENA)


def _valid(model: str, batch: int) -> dict:
    """A request the model accepts, as the starting point for one mutation."""
    view = CATALOG.get(model)
    lead = [batch] if view.max_batch_size else []
    inputs = []
    for spec in view.inputs.values():
        shape = lead + [d if d >= 0 else 2 for d in spec.dims]
        n = 1
        for d in shape:
            n *= d
        data = ["ab"] * n if spec.datatype == "BYTES" else [True] * n if spec.datatype == "BOOL" \
            else [1] * n
        inputs.append({"name": spec.name, "datatype": spec.datatype, "shape": shape, "data": data})
    return {"inputs": inputs}


@given(model=st.sampled_from(sorted(m for m in CONFIGS if m not in ("half",))),
       batch=st.integers(1, 3), where=st.integers(0, 3),
       field=st.sampled_from(["name", "datatype", "shape", "data", "parameters", None]),
       value=json_values)
def test_infer_one_mutation_of_a_valid_request(model, batch, where, field, value):
    doc = _valid(model, batch)
    if field is not None and doc["inputs"]:
        doc["inputs"][where % len(doc["inputs"])][field] = value
    _parse(model, json.dumps(doc).encode(), None)


@given(model=st.sampled_from(sorted(CONFIGS)), doc=infer_doc,
       tail=st.binary(max_size=64), header_len=st.one_of(st.none(), st.integers(-5, 400)))
def test_infer_json_and_binary_parts(model, doc, tail, header_len):
    head = json.dumps(doc).encode()
    _parse(model, head + tail, len(head) if header_len is None and tail else header_len)


@given(model=st.sampled_from(sorted(CONFIGS)), body=st.binary(max_size=300),
       header_len=st.one_of(st.none(), st.just(0), st.integers(-5, 400)))
def test_infer_any_bytes(model, body, header_len):
    _parse(model, body, header_len)


# ---- the HTTP/1.1 layer ---------------------------------------------------------------------------
class Transport:
    def __init__(self):
        self.out = bytearray()
        self.closed = False

    def write(self, data):
        self.out += data

    def close(self):
        self.closed = True

    def can_write_eof(self):
        return False        # an error closes at once (lingering needs a running loop)

    def get_write_buffer_size(self):
        return 0

    def set_write_buffer_limits(self, high=None, low=None):
        pass

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 5000) if name == "peername" else default


class EchoApp(HttpApp):
    """Answers every complete request 200, and says how long a body may be."""

    def __init__(self):
        self.requests = 0

    def check_body_size(self, req, n):
        return f"request body of {n} bytes exceeds the limit of 256 bytes" if n > 256 else ""

    def handle(self, conn, req):
        self.requests += 1
        conn.respond(req, 200, b"{}")


METHODS = [b"GET", b"POST", b"PUT", b"HEAD", b"DELETE", b"G\x00T", b""]
lines = st.builds(lambda m, p, v: m + b" " + p + b" " + v + b"\r\n", st.sampled_from(METHODS),
                  st.one_of(st.just(b"/v2/models/m/infer"), st.binary(max_size=20)),
                  st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/9.9", b"", b"XYZ"]))
headers = st.lists(st.one_of(
    st.builds(lambda v: b"Content-Length: " + v + b"\r\n",
              st.one_of(st.integers(-5, 1000).map(lambda n: str(n).encode()), st.binary(max_size=6))),
    st.just(b"Transfer-Encoding: chunked\r\n"), st.just(b"Connection: close\r\n"),
    st.just(b"Expect: 100-continue\r\n"), st.binary(max_size=30).map(lambda b: b + b"\r\n")),
    max_size=5)
messages = st.builds(lambda line, hs, body: line + b"".join(hs) + b"\r\n" + body, lines, headers,
                     st.binary(max_size=300))

STATUS = re.compile(rb"HTTP/1\.1 (\d{3}) ")


@given(stream=st.lists(st.one_of(messages, st.binary(max_size=100)), min_size=1, max_size=4),
       cut=st.integers(1, 64))
def test_http_parser_never_raises_or_answers_5xx(stream, cut):
    conn = HttpConnection(EchoApp())
    t = Transport()
    conn.connection_made(t)
    data = b"".join(stream)
    for i in range(0, len(data), cut):       # arbitrary packet boundaries
        if conn.closed:
            break
        conn.data_received(data[i:i + cut])
    conn.connection_lost(None)
    for status in STATUS.findall(bytes(t.out)):
        assert int(status) < 500, bytes(t.out)
