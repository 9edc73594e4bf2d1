"""HTTP routing: the Router on its own (404, 405, captures), and every route of the KServe app."""
import json
from functools import partial

import pytest
from frontend_fakes import FakeConn, http, make_service

from shmserve.frontend.http.app import KServeHttpApp
from shmserve.frontend.http.routes import Router
from shmserve.frontend.http.server import HttpRequest


def h_get(*a, **kw):
    return "get"


def h_post(*a, **kw):
    return "post"


def h_other(*a, **kw):
    return "other"


@pytest.fixture
def router():
    return Router([
        ("GET", "/v2/health/live", h_get),
        (("GET", "POST"), "/v2/both", h_get),
        ("GET", "/v2/models/{model}", h_get),
        ("GET", "/v2/models/{model}/ready", h_get),
        ("POST", "/v2/models/{model}/infer", h_post),
        ("DELETE", "/v2/models/{model}/infer", h_other),
        ("POST", "/v2/models/{model}/versions/{version}/infer", h_post),
        ("PUT", "/v2/models/{model}/{what}", h_other),
    ])


def test_exact_path(router):
    assert router.match("GET", "/v2/health/live") == (h_get, [])
    assert router.match("POST", "/v2/both") == (h_get, [])


def test_exact_path_wrong_method_is_405_with_allowed_methods(router):
    assert router.match("POST", "/v2/health/live") == (None, "GET")
    assert router.match("PUT", "/v2/both") == (None, "GET, POST")


def test_captures(router):
    assert router.match("POST", "/v2/models/simple/infer") == (h_post, ["simple"])
    assert router.match("DELETE", "/v2/models/simple/infer") == (h_other, ["simple"])
    assert router.match("POST", "/v2/models/m/versions/3/infer") == \
        (h_post, ["m", "3"])


def test_captures_are_unquoted_after_splitting(router):
    assert router.match("GET", "/v2/models/a%20b%2Fc/ready") == (h_get, ["a b/c"])


def test_a_literal_last_segment_does_not_hide_a_capture_there(router):
    # "infer" is a literal of one pattern and the model name of another
    assert router.match("GET", "/v2/models/infer") == (h_get, ["infer"])
    assert router.match("PUT", "/v2/models/m/infer") == (h_other, ["m", "infer"])


def test_pattern_wrong_method_lists_every_matching_pattern(router):
    assert router.match("GET", "/v2/models/m/infer") == (None, "DELETE, POST, PUT")
    assert router.match("POST", "/v2/models/m") == (None, "GET")


@pytest.mark.parametrize("path", ["/v2/nothing", "/v2/models", "/v2/models/", "/v2/models//ready",
                                  "/v2/models/m/versions//infer", "/v2/models/m/a/b",
                                  "/v2/health/live/", "v2/models/m", "x/v2/models/m/infer", ""])
def test_no_match_is_404(router, path):
    assert router.match("GET", path) == (None, "")


def test_bad_tables_are_refused():
    with pytest.raises(ValueError, match="defined twice"):
        Router([("GET", "/a/{x}", h_get), (("POST", "GET"), "/a/{x}", h_post)])
    with pytest.raises(ValueError, match="defined twice"):
        Router([("GET", "/a", h_get), ("GET", "/a", h_post)])
    with pytest.raises(ValueError, match="must start with"):
        Router([("GET", "a/{x}", h_get)])


# ---- the app's table ----------------------------------------------------------------------------
def _model_routes(prefix, captures):
    return [("GET", prefix, "model_metadata", (), captures),
            ("GET", prefix + "/ready", "model_ready", (), captures),
            ("GET", prefix + "/config", "model_config", (), captures),
            ("GET", prefix + "/stats", "statistics", (), captures),
            ("POST", prefix + "/infer", "infer", (), captures),
            ("POST", prefix + "/generate", "generate", (), captures),
            ("POST", prefix + "/generate_stream", "generate_stream", (), captures)]


def _shm_routes(kind, system):
    out = []
    for prefix, captures in ((f"/v2/{kind}", []), (f"/v2/{kind}/region/r%201", ["r 1"])):
        out += [("GET", prefix + "/status", "shm_status", (system,), captures),
                ("POST", prefix + "/register", "shm_register", (system,), captures),
                ("POST", prefix + "/unregister", "shm_unregister", (system,), captures)]
    return out


# (method, path, handler name, bound leading arguments, captures in pattern order): one row per
# route in the table
EVERY_ROUTE = [
    ("GET", "/v2/health/live", "live", (), []),
    ("GET", "/v2/health/ready", "ready", (), []),
    ("GET", "/v2", "metadata", (), []),
    ("GET", "/v2/", "metadata", (), []),
    ("POST", "/v2/repository/index", "repository_index", (), []),
    ("POST", "/v2/repository/models/m%2Fx/load", "control", ("load",), ["m/x"]),
    ("POST", "/v2/repository/models/m/unload", "control", ("unload",), ["m"]),
    ("POST", "/v2/repository/r/models/m/load", "control_in_repository", ("load",), ["r", "m"]),
    ("POST", "/v2/repository/r/models/m/unload", "control_in_repository", ("unload",),
     ["r", "m"]),
    ("GET", "/v2/models/stats", "statistics", (), []),
    ("GET", "/v2/logging", "get_logging", (), []),
    ("POST", "/v2/logging", "update_logging", (), []),
    ("GET", "/v2/trace/setting", "get_trace", (), []),
    ("POST", "/v2/trace/setting", "update_trace", (), []),
    ("GET", "/v2/models/m/trace/setting", "get_trace", (), ["m"]),
    ("POST", "/v2/models/m/trace/setting", "update_trace", (), ["m"]),
    *_model_routes("/v2/models/my%20model", ["my model"]),
    *_model_routes("/v2/models/m/versions/2", ["m", "2"]),
    *_shm_routes("systemsharedmemory", True),
    *_shm_routes("cudasharedmemory", False),
]


@pytest.fixture
def app():
    return KServeHttpApp(make_service(), 1 << 20)


def test_every_route_is_listed_once(app):
    assert len(app.routes()) == len(EVERY_ROUTE)


@pytest.mark.parametrize("route", EVERY_ROUTE, ids=[f"{r[0]} {r[1]}" for r in EVERY_ROUTE])
def test_every_route_resolves(app, route):
    method, path, name, bound, captures = route
    handler, got = app.router.match(method, path)
    assert handler is not None, f"{method} {path} did not resolve"
    func = handler.func if isinstance(handler, partial) else handler
    assert func.__name__ == name
    assert (handler.args if isinstance(handler, partial) else ()) == bound
    assert got == captures
    other = "POST" if method == "GET" else "GET"
    if (other, path) not in {(r[0], r[1]) for r in EVERY_ROUTE}:      # /v2/logging takes both
        assert app.router.match(other, path) == (None, method)


# ---- what the app answers where the router decides ----------------------------------------------
@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v2/nothing/here", 404),
    ("GET", "/v2/models/simple/config/extra", 404),
    ("GET", "/v2/systemsharedmemoryX/status", 404),
    ("GET", "/v2/systemsharedmemory/region/r/bogus", 404),
    ("POST", "/v2/repository/models/m/reload", 404),
    ("GET", "/v2/models/m/versions/1/trace/setting", 404),     # no version here, as Triton
    ("GET", "/v2/models/simple/infer", 405),
    ("POST", "/v2/health/live", 405),
    ("DELETE", "/v2/models/simple", 405),
    ("POST", "/v2/models/stats", 405),
    ("GET", "/v2/repository/models/m/load", 405),
])
def test_router_errors(app, method, path, status):
    got, body, headers = http(app, method, path)
    assert got == status
    if status == 404:
        assert json.loads(body) == {"error": "Not Found"} and headers == {}
    else:
        assert json.loads(body) == {"error": "Method Not Allowed"} and "Allow" in headers


def test_answers_of_simple_routes(app):
    assert http(app, "GET", "/v2/health/live") == (200, b"", {})
    status, body, _ = http(app, "GET", "/v2")
    assert status == 200 and json.loads(body)["name"] == "shmserve-test"
    status, body, _ = http(app, "GET", "/v2/models/simple/versions/1")
    assert status == 200 and json.loads(body)["versions"] == ["1"]
    assert http(app, "GET", "/v2/models/simple/ready")[0] == 200
    status, body, _ = http(app, "GET", "/v2/models/no%20such")
    assert status == 404 and "'no such'" in json.loads(body)["error"]
    assert http(app, "GET", "/v2/models/simple/versions/x")[0] == 404     # digits only
    assert http(app, "GET", "/v2/models/simple/versions/%C2%B2")[0] == 404
    status, body, _ = http(app, "GET", "/v2/models/stats")
    assert status == 200 and json.loads(body)["model_stats"][0]["name"] == "simple"
    assert http(app, "POST", "/v2/repository/models/simple/load")[0] == 200
    status, body, _ = http(app, "POST", "/v2/repository/r/models/simple/load")
    assert status == 501 and "repository names are not supported" in json.loads(body)["error"]
    status, body, _ = http(app, "POST", "/v2/systemsharedmemory/register", b"{}")
    assert status == 400 and "needs a region name" in json.loads(body)["error"]
    assert http(app, "GET", "/v2/cudasharedmemory/status") == (200, b"[]", {})


class FakeSlot:
    def __init__(self):
        self.ref = object()


class FakeArena:
    def __init__(self):
        self.freed = []

    def free(self, ref):
        self.freed.append(ref)


@pytest.mark.parametrize("method, path", [("POST", "/v2/models/a/b/infer"),
                                          ("PUT", "/v2/models/simple/infer"),
                                          ("POST", "/v2/models/nope/infer")])
def test_a_body_in_shared_memory_is_freed_when_the_request_fails(app, method, path):
    app.arena = FakeArena()
    req = HttpRequest(method, path.encode(), {})
    slot = req.body_slot = FakeSlot()
    conn = FakeConn()
    app.handle(conn, req)
    assert conn.responses[0][0] in (404, 405)
    assert app.arena.freed == [slot.ref] and req.body_slot is None
