"""Model directories whose files are not plain files: a FIFO, a directory, a symlink loop, a
device or a huge sparse file where config.pbtxt, model.py, a label file or a warm-up data file
should be. Each load is refused at once with 400 naming the file, the model shows UNAVAILABLE
with the reason, and the server goes on serving the other models; none blocks a process (a
FIFO opened for reading waits for a writer for ever), at start-up either."""
import os
import shutil

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from repo_builder import IDENTITY, write_model
from serverproc import Server, wait_for

CONFIG = '''
    backend: "python"
    max_batch_size: 8
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] LABELS } ]
    WARMUP
'''
LABELS = 'label_filename: "labels.txt"'
WARMUP = '''model_warmup [ { name: "w" batch_size: 1 inputs { key: "INPUT0" value: {
                  data_type: TYPE_FP32 dims: [ 4 ] input_data_file: "data" } } } ]'''


def _config(labels: bool = False, warmup: bool = False) -> str:
    return CONFIG.replace("LABELS", LABELS if labels else "").replace(
        "WARMUP", WARMUP if warmup else "")


def _make_bad(path: str, kind: str) -> None:
    """Put a ``kind`` of non-file at ``path``."""
    if os.path.lexists(path):
        os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "symlink loop":
        os.symlink(os.path.basename(path), path)
    elif kind == "device":
        os.symlink("/dev/zero", path)
    elif kind == "sparse 10 GB":
        with open(path, "wb") as f:
            f.truncate(10 << 30)
    else:
        raise ValueError(kind)


EXPECTED = {
    "fifo": "it is a FIFO (named pipe), not a regular file",
    "directory": "it is a directory, not a regular file",
    "symlink loop": "Too many levels of symbolic links",
    "device": "it is a character device, not a regular file",
    "sparse 10 GB": "it holds 10737418240 bytes, more than the limit of 1048576",
}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("badrepo"))
    write_model(root, "good", _config(), IDENTITY)
    return root


@pytest.fixture(scope="module")
def srv(repo):
    s = Server(repo, "--model-control-mode", "explicit", "--load-model", "good")
    yield s
    assert s.stop() == 0


def _load(srv, name: str):
    # a load that blocked would time out here: before, a FIFO config.pbtxt never answered
    return requests.post(f"{srv.base}/v2/repository/models/{name}/load", timeout=30)


def _good_serves(srv):
    c = httpclient.InferenceServerClient(srv.url, network_timeout=30)
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    inp = httpclient.InferInput("INPUT0", x.shape, "FP32")
    inp.set_data_from_numpy(x)
    np.testing.assert_array_equal(c.infer("good", [inp]).as_numpy("OUTPUT0"), x)
    c.close()


def _index(srv) -> dict:
    return {e["name"]: e for e in
            requests.post(f"{srv.base}/v2/repository/index", timeout=10).json()}


def _new_model(repo: str, name: str, **kw) -> str:
    write_model(repo, name, _config(**kw), IDENTITY)
    return os.path.join(repo, name)


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_a_config_that_is_not_a_file_is_refused_naming_it(srv, repo, kind):
    name = "cfg_" + kind.replace(" ", "_")
    path = os.path.join(_new_model(repo, name), "config.pbtxt")
    _make_bad(path, kind)
    r = _load(srv, name)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == (f"failed to load '{name}': failed to open text file for read "
                                 f"{path}: {EXPECTED[kind]}")
    entry = _index(srv)[name]
    assert entry["state"] == "UNAVAILABLE" and path in entry["reason"]
    _good_serves(srv)


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink loop"])
def test_a_model_file_that_is_not_a_file_is_refused_naming_it(srv, repo, kind):
    name = "py_" + kind.replace(" ", "_")
    path = os.path.join(_new_model(repo, name), "1", "model.py")
    _make_bad(path, kind)
    r = _load(srv, name)
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith(f"load failed for model '{name}': ")
    assert f"model file {path} cannot be used: " in r.json()["error"]
    assert _index(srv)[name]["state"] == "UNAVAILABLE"
    _good_serves(srv)


@pytest.mark.parametrize("what", ["labels", "warmup"])
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_label_or_warmup_file_that_is_not_a_file_fails_the_load(srv, repo, what, kind):
    """Read by the worker as it loads: before, a FIFO held the load until the load timeout."""
    name = f"{what}_{kind}"
    d = _new_model(repo, name, labels=what == "labels", warmup=what == "warmup")
    if what == "labels":
        path = os.path.join(d, "labels.txt")
    else:
        os.makedirs(os.path.join(d, "warmup"), exist_ok=True)
        path = os.path.join(d, "warmup", "data")
    _make_bad(path, kind)
    r = _load(srv, name)
    assert r.status_code == 400, r.text
    assert path in r.json()["error"] and EXPECTED[kind] in r.json()["error"], r.text
    assert _index(srv)[name]["state"] == "UNAVAILABLE"
    _good_serves(srv)


def test_an_unreadable_config_is_refused_naming_it(srv, repo):
    if os.geteuid() == 0:
        pytest.skip("root reads a file of mode 000: the tests run as root here")
    name = "cfg_unreadable"
    path = os.path.join(_new_model(repo, name), "config.pbtxt")
    os.chmod(path, 0)
    r = _load(srv, name)
    assert r.status_code == 400 and "Permission denied" in r.json()["error"], r.text
    _good_serves(srv)


@pytest.fixture
def startup_repo(tmp_path):
    root = str(tmp_path / "repo")
    write_model(root, "good", _config(), IDENTITY)
    # a file of a good model that a poll's walk over the directory cannot stat
    os.symlink("loop", os.path.join(root, "good", "loop"))
    bad = os.path.join(root, "bad")
    write_model(root, "bad", _config(), IDENTITY)
    os.unlink(os.path.join(bad, "config.pbtxt"))
    os.mkdir(os.path.join(bad, "config.pbtxt"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_at_startup_a_bad_model_leaves_the_others_serving(startup_repo):
    # not ready as a whole: Triton's strict readiness counts the failed model
    srv = Server(startup_repo, "--model-control-mode", "poll", "--repository-poll-secs", "1",
                 wait_ready=False)
    try:
        wait_for(lambda: srv.model_ready("good"), 60, "the good model to be ready")
        _good_serves(srv)
        entry = _index(srv)["bad"]
        assert entry["state"] == "UNAVAILABLE"
        assert "failed to open text file for read " in entry["reason"]
        assert "config.pbtxt: it is a directory, not a regular file" in entry["reason"]
        assert "Traceback" not in srv.log_text()
    finally:
        assert srv.stop() == 0


def test_at_startup_with_exit_on_error_a_bad_model_stops_the_server_cleanly(startup_repo):
    """Triton's --exit-on-error=true: a model that fails to load at start-up stops the
    server, with the reason, and no traceback."""
    srv = Server(startup_repo, "--exit-on-error", "true", wait_ports=False)
    try:
        assert srv.proc.wait(60) == 1
        log = srv.log_text()
        assert "failed to load bad" in log and "exiting because --exit-on-error is true" in log
        assert "Traceback" not in log, log
    finally:
        srv.stop()
