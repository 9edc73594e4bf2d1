"""Response statistics (``response_stats``) of a decoupled square model, read over HTTP and
gRPC with tritonclient, as Triton's own response statistics check reads them: per response
index, aggregated over requests that send different numbers of responses, the last ones of
each failing or left empty."""
import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from repo_builder import write_model
from serverproc import Server, wait_for

INFER_NS, OUTPUT_NS = 40_000_000, 20_000_000
FAIL, EMPTY = 2, 1
SQUARE = f"""
    backend: "square"
    max_batch_size: 0
    model_transaction_policy {{ decoupled: true }}
    input [ {{ name: "IN", data_type: TYPE_INT32, dims: [ 1 ] }} ]
    output [ {{ name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] }} ]
    parameters [ {{ key: "CUSTOM_INFER_DELAY_NS", value: {{ string_value: "{INFER_NS}" }} }},
                 {{ key: "CUSTOM_OUTPUT_DELAY_NS", value: {{ string_value: "{OUTPUT_NS}" }} }},
                 {{ key: "CUSTOM_FAIL_COUNT", value: {{ string_value: "{FAIL}" }} }},
                 {{ key: "CUSTOM_EMPTY_COUNT", value: {{ string_value: "{EMPTY}" }} }} ]
"""
PLAIN = """
    backend: "identity"
    max_batch_size: 0
    input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ 1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""
SLOW = """
    backend: "square"
    max_batch_size: 0
    model_transaction_policy { decoupled: true }
    input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
    output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
    parameters [ { key: "CUSTOM_INFER_DELAY_NS", value: { string_value: "300000000" } },
                 { key: "CUSTOM_CANCEL_DELAY_NS", value: { string_value: "50000000" } } ]
"""
KINDS = ("compute_infer", "compute_output", "success", "fail", "empty_response", "cancel")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("response_stats"))
    write_model(repo, "square_int32", SQUARE, None)
    write_model(repo, "plain", PLAIN, None)
    write_model(repo, "square_slow", SLOW, None)
    srv = Server(repo)
    try:
        wait_for(lambda: all(srv.model_ready(m) for m in ("square_int32", "plain",
                                                          "square_slow")),
                 60, "the models to load")
        yield srv
    finally:
        assert srv.stop() == 0


def _stream(server, n):
    """Send one request for ``n`` responses; wait for those the model sends (successes and
    failures: the empty ones send nothing)."""
    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    x = grpcclient.InferInput("IN", [1], "INT32")
    x.set_data_from_numpy(np.array([n], np.int32))
    c.async_stream_infer("square_int32", [x])
    answers = [got.get(timeout=30) for _ in range(n - EMPTY)]
    c.stop_stream()
    c.close()
    return answers


def _expected(counts, n):
    """Add a request of ``n`` responses to the expected counts per index."""
    for i in range(n):
        if i == len(counts):
            counts.append(dict.fromkeys(KINDS, 0))
        c = counts[i]
        c["compute_infer"] += 1
        if i + FAIL + EMPTY < n:
            c["compute_output"] += 1
            c["success"] += 1
        elif i + EMPTY < n:
            c["compute_output"] += 1
            c["fail"] += 1
        else:
            c["empty_response"] += 1


def _both(server, model="square_int32"):
    """response_stats over HTTP, after checking gRPC reports the same. A stream still running
    may add a response between the two queries: they are compared once HTTP reads the same
    before and after the gRPC query."""
    http = httpclient.InferenceServerClient(server.url)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)

    def read():
        before = http.get_inference_statistics(model)["model_stats"][0]["response_stats"]
        by_grpc = grpc.get_inference_statistics(model, as_json=True)["model_stats"][0]
        after = http.get_inference_statistics(model)["model_stats"][0]["response_stats"]
        return (after, by_grpc.get("response_stats", {})) if before == after else None
    try:
        rs_http, rs_grpc = wait_for(read, 30, "the statistics to hold still for two queries")
    finally:
        http.close()
        grpc.close()
    assert sorted(rs_http) == sorted(rs_grpc)
    for index, kinds in rs_http.items():
        assert sorted(kinds) == sorted(KINDS)
        for kind, d in kinds.items():
            g = rs_grpc[index][kind]      # proto JSON: a zero field is left out
            assert d == {"count": int(g.get("count", 0)), "ns": int(g.get("ns", 0))}
    return rs_http


def _counted(rs, counts):
    """``rs`` if its counts are ``counts``, else None."""
    got = [{k: rs[str(i)][k]["count"] for k in KINDS} for i in range(len(rs))]
    return rs if got == counts else None


def test_response_statistics_aggregate_per_response_index(server):
    counts: list[dict] = []
    for n in (4, 6, 3):
        answers = _stream(server, n)
        errors = [str(e) for _, e in answers if e is not None]
        assert len(errors) == FAIL and all("simulated failure" in e for e in errors)
        _expected(counts, n)
        # the worker reports each response to the scheduler right after sending it: the
        # last report may still be on its way when the client has its last response
        got = wait_for(lambda: _counted(_both(server), counts), 30,
                       f"the response statistics after a request of {n}")
        for i, c in enumerate(counts):
            stats = got[str(i)]
            # each stat is at least the model's sleeps (no upper bound: the machine is shared)
            assert stats["compute_infer"]["ns"] >= 0.9 * INFER_NS * c["compute_infer"]
            assert stats["compute_output"]["ns"] >= 0.9 * OUTPUT_NS * c["compute_output"]
            for kind in ("success", "fail"):
                assert stats[kind]["ns"] >= 0.9 * (INFER_NS + OUTPUT_NS) * c[kind]
            assert stats["empty_response"]["ns"] >= 0.9 * INFER_NS * c["empty_response"]
            assert stats["cancel"] == {"count": 0, "ns": 0}


def test_a_cancelled_stream_reports_its_cancel_at_the_next_index(server):
    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    x = grpcclient.InferInput("IN", [1], "INT32")
    x.set_data_from_numpy(np.array([50], np.int32))
    c.async_stream_infer("square_slow", [x])
    assert got.get(timeout=30)[1] is None           # the first response
    c.stop_stream(cancel_requests=True)
    c.close()

    def cancelled():
        rs = _both(server, "square_slow")
        hit = [k for k, v in rs.items() if v["cancel"]["count"]]
        return (rs, hit) if hit else None
    rs, hit = wait_for(cancelled, 30, "the cancel in the response statistics")
    [index] = hit
    # responses before it succeeded; the cancel is the last index and counts only its clean-up
    assert int(index) >= 1 and sorted(rs, key=int)[-1] == index
    assert all(rs[str(i)]["success"]["count"] == 1 for i in range(int(index)))
    assert rs[index]["cancel"]["ns"] >= 0.9 * 50_000_000
    assert rs[index]["compute_infer"]["count"] == rs[index]["success"]["count"] == 0


def test_a_model_that_reports_nothing_has_no_response_statistics(server):
    c = httpclient.InferenceServerClient(server.url)
    try:
        x = httpclient.InferInput("INPUT0", [1], "INT32")
        x.set_data_from_numpy(np.array([7], np.int32))
        assert c.infer("plain", [x]).as_numpy("OUTPUT0").tolist() == [7]
        assert c.get_inference_statistics("plain")["model_stats"][0]["response_stats"] == {}
    finally:
        c.close()
