"""gRPC over TLS (--grpc-use-ssl, --grpc-use-ssl-mutual) against a real server, with
tritonclient's and perf_analyzer's TLS options: a client that trusts the server's CA is served,
one that does not (or speaks plain gRPC, or lacks a certificate under mutual TLS) is refused at
the handshake, and HTTP stays as it was."""
import subprocess

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from certs import make_certs
from serverproc import Server
from tritonclient.utils import InferenceServerException


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(str(tmp_path_factory.mktemp("certs")))


def tls_flags(certs, mutual=False):
    flags = ["--grpc-use-ssl", "true", "--grpc-server-cert", certs.server_cert,
             "--grpc-server-key", certs.server_key, "--load-model", "simple",
             "--model-control-mode", "explicit"]
    if mutual:
        flags += ["--grpc-use-ssl-mutual", "true", "--grpc-root-cert", certs.ca]
    return flags


def simple_inputs():
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        x = grpcclient.InferInput(name, [1, 16], "INT32")
        x.set_data_from_numpy(a)
        inputs.append(x)
    return inputs, a


def infer_ok(client):
    inputs, a = simple_inputs()
    res = client.infer("simple", inputs)
    np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), a + a)


def refused(client):
    with pytest.raises(InferenceServerException):
        client.is_server_live(client_timeout=5)


@pytest.fixture(scope="module", params=["loop", "aio"])
def tls_server(request, example_repo, certs):
    """Both gRPC servers do TLS: the loop server through the event loop's, grpc.aio its own."""
    s = Server(example_repo, *tls_flags(certs), "--grpc-server", request.param)
    yield s
    s.stop()


def test_a_client_that_trusts_the_ca_is_served(tls_server, certs):
    c = grpcclient.InferenceServerClient(tls_server.grpc_url, ssl=True,
                                         root_certificates=certs.ca)
    assert c.is_server_live() and c.is_model_ready("simple")
    infer_ok(c)
    # streaming too
    results = []
    c.start_stream(callback=lambda result, error: results.append((result, error)))
    inputs, _ = simple_inputs()
    c.async_stream_infer("simple", inputs)
    c.stop_stream()
    assert len(results) == 1 and results[0][1] is None


def test_plain_and_untrusting_clients_are_refused_and_http_is_unchanged(tls_server, certs):
    refused(grpcclient.InferenceServerClient(tls_server.grpc_url))
    refused(grpcclient.InferenceServerClient(tls_server.grpc_url, ssl=True,
                                             root_certificates=certs.other_ca))
    assert httpclient.InferenceServerClient(tls_server.url).is_server_live()
    # the server serves on after the refused handshakes
    infer_ok(grpcclient.InferenceServerClient(tls_server.grpc_url, ssl=True,
                                              root_certificates=certs.ca))


@pytest.mark.parametrize("kind", ["loop", "aio"])
def test_mutual_tls_needs_a_client_certificate(example_repo, certs, kind):
    s = Server(example_repo, *tls_flags(certs, mutual=True), "--grpc-server", kind)
    try:
        refused(grpcclient.InferenceServerClient(s.grpc_url, ssl=True,
                                                 root_certificates=certs.ca))
        c = grpcclient.InferenceServerClient(s.grpc_url, ssl=True, root_certificates=certs.ca,
                                             private_key=certs.client_key,
                                             certificate_chain=certs.client_cert)
        infer_ok(c)
    finally:
        s.stop()


def test_perf_analyzer_over_tls(tls_server, certs, perf_analyzer):
    out = subprocess.run([perf_analyzer, "-m", "simple", "-u", tls_server.grpc_url, "-i", "grpc",
                          "--ssl-grpc-use-ssl", "--ssl-grpc-root-certifications-file", certs.ca,
                          "--concurrency-range", "1", "--measurement-interval", "500",
                          "--max-trials", "4", "--stability-percentage", "999"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Throughput:" in out.stdout
