"""One poison request among good ones: it fails alone, the good ones all succeed and the model
stays READY (issue 13). bench/poison.py runs the same scenario longer and reports latencies.
A poison run alone costs one worker, not two, and no number of them makes a crash loop."""
import re
import threading
import time

import numpy as np
import pytest
import tritonclient.http as httpclient
from repo_builder import POISON, POISON_CONFIG, write_model
from serverproc import Server, wait_for
from tritonclient.utils import InferenceServerException

CLIENTS = 4
DURATION_S = 6.0
POISON_EVERY_S = 1.5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("poison"))
    write_model(repo, "poisonable", POISON_CONFIG, POISON)
    s = Server(repo)
    yield s
    assert s.stop() == 0


def _infer(client, value: int):
    inp = httpclient.InferInput("INPUT0", [1, 1], "INT32")
    inp.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    return client.infer("poisonable", [inp])


def test_poison_fails_alone_while_good_requests_all_succeed(server):
    good, failures, poisoned = [], [], []
    stop = time.monotonic() + DURATION_S

    def client_loop(k):
        c = httpclient.InferenceServerClient(server.url, network_timeout=60)
        i = 0
        while time.monotonic() < stop:
            i += 1
            try:
                r = _infer(c, k * 100000 + i)
                assert int(r.as_numpy("OUTPUT0")[0, 0]) == k * 100000 + i
                good.append(i)
            except Exception as e:              # noqa: BLE001 - counted and reported below
                failures.append(repr(e))
        c.close()

    def poison_loop():
        c = httpclient.InferenceServerClient(server.url, network_timeout=60)
        while time.monotonic() < stop - POISON_EVERY_S:
            with pytest.raises(InferenceServerException) as e:
                _infer(c, -1)
            poisoned.append(e.value)
            # pacing of the scenario itself, not synchronisation
            time.sleep(POISON_EVERY_S)
        c.close()

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(CLIENTS)]
    threads.append(threading.Thread(target=poison_loop))
    for t in threads:
        t.start()
    for t in threads:
        t.join(DURATION_S + 120)
    assert not any(t.is_alive() for t in threads)
    assert failures == []                       # not one good request was lost or failed
    assert good and len(poisoned) >= 2
    for e in poisoned:
        assert e.status() == "500"
        assert "exited unexpectedly (exit code 3) while executing this request" in e.message()
        # run alone, it is taken for the cause at once; in a batch, it had its retry alone
        assert "taken for the cause and not retried" in e.message() or \
            "retried alone after an earlier worker death" in e.message()
    # never a crash loop (good work came between): ready again once the instance restarted
    wait_for(lambda: server.model_ready("poisonable"), 30, "the restarted instance")


def _deaths(srv) -> int:
    return len(re.findall(r"of model 'poisonable' exited unexpectedly \(exit code 3\); "
                          r"restarting", srv.log_text()))


@pytest.mark.parametrize("leases", ["true", "false"])
def test_each_poison_costs_one_worker_and_never_a_crash_loop(tmp_path, leases):
    """20 poison requests, each between two good ones: every poison fails at once (500, the
    cause named), never runs on a second worker, and the model stays READY throughout: a
    client sending poison cannot take the model down for the others. With leases the
    frontend sends the requests straight to the worker; without, the scheduler does."""
    repo = str(tmp_path)
    write_model(repo, "poisonable", POISON_CONFIG, POISON)
    srv = Server(repo, "--instance-leases", leases)
    try:
        c = httpclient.InferenceServerClient(srv.url, network_timeout=60)
        poisons = 20
        for i in range(poisons):
            assert int(_infer(c, i).as_numpy("OUTPUT0")[0, 0]) == i
            with pytest.raises(InferenceServerException) as e:
                _infer(c, -1)
            assert e.value.status() == "500", e.value.message()
            assert "exited unexpectedly (exit code 3) while executing this request; it was the " \
                   "only request the worker was running, so it is taken for the cause and not " \
                   "retried" in e.value.message()
            wait_for(lambda: srv.model_ready("poisonable"), 30, "the restarted instance")
        assert int(_infer(c, 7).as_numpy("OUTPUT0")[0, 0]) == 7
        c.close()
        wait_for(lambda: _deaths(srv) >= poisons, 20, "the deaths to be logged")
        assert _deaths(srv) == poisons              # one worker each, none retried elsewhere
    finally:
        assert srv.stop() == 0
