"""Route resolution and dispatch of the HTTP infer path (frontend/http/routes.py), on a table
shaped like the server's, in one process:

    python bench/http_routes.py
"""
from __future__ import annotations

from functools import partial

from shmserve.frontend.http.routes import Router


def main() -> None:
    """Route resolution and dispatch of the infer path on a table shaped like http_app's."""
    import timeit

    def infer(conn, req, model, version=""):
        return None

    def other(*args):
        return None

    router = Router([
        ("GET", "/v2/health/live", other), ("GET", "/v2/health/ready", other),
        ("GET", "/v2", other), ("GET", "/v2/models/stats", other),
        ("POST", "/v2/repository/index", other),
        ("GET", "/v2/models/{model}", other), ("GET", "/v2/models/{model}/ready", other),
        ("GET", "/v2/models/{model}/config", other), ("GET", "/v2/models/{model}/stats", other),
        ("POST", "/v2/models/{model}/infer", infer),
        ("GET", "/v2/models/{model}/versions/{version}", other),
        ("POST", "/v2/models/{model}/versions/{version}/infer", infer),
    ])

    def dispatch(path):
        handler, captures = router.match("POST", path)
        assert handler is not None
        handler(None, None, *captures)

    for path in ("/v2/models/simple/infer", "/v2/models/simple/versions/1/infer"):
        n = 100_000
        t = min(timeit.repeat(partial(dispatch, path), number=n, repeat=5))
        print(f"{path}: {t / n * 1e9:.0f} ns per match and call")


if __name__ == "__main__":
    main()
