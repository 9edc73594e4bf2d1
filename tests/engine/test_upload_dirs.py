"""Uploaded models on the scheduler's side (engine/lifecycle/uploads.py, engine/lifecycle/loading.py): a load from
an upload directory, and that directory's removal once nothing loads, serves or drains from it.
In-process, on the fake port and clock (tests/engine/fakes.py)."""
import json
import os
import tempfile

import pytest
from fakes import IO, ONE, Harness, write_model

from shmserve.ipc.messages.common import ControlAction, ErrorCode, ModelState, StateCause
from shmserve.ipc.messages.to_scheduler import ControlRequest
from shmserve.ipc.messages.to_worker import Shutdown

CONFIG = json.dumps({
    "backend": "python", "max_batch_size": 8,
    "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
    "instance_group": [{"count": 1, "kind": "KIND_CPU"}]})


@pytest.fixture
def repo(tmp_path):
    r = str(tmp_path / "models")
    write_model(r, "plain", f"max_batch_size: 8\n{IO}\n{ONE}")
    return r


@pytest.fixture
def root(tmp_path):
    path = tmp_path / "run" / "uploads"
    path.mkdir(parents=True)
    return str(path)


def upload(root: str, versions=(1,)) -> str:
    """What the frontend leaves for the scheduler: a model directory right under the root."""
    path = os.path.realpath(tempfile.mkdtemp(prefix="model-", dir=root))
    for v in versions:
        os.makedirs(os.path.join(path, str(v)))
        with open(os.path.join(path, str(v), "model.py"), "w") as f:
            f.write("class TritonPythonModel:\n    pass\n")
    return path


def harness(repo, root, **settings) -> Harness:
    settings.setdefault("model_control_mode", "explicit")
    return Harness(repo, model_upload_dir=root, **settings).start()


def load(h, name, config="", upload_dir=""):
    h.core.handle(ControlRequest(0, len(h.replies()) + 100, ControlAction.LOAD, name, config,
                                 False, upload_dir))


def unload(h, name):
    h.core.handle(ControlRequest(0, len(h.replies()) + 100, ControlAction.UNLOAD, name))


def names(h):
    return [m.name for m in h.table().models]


def test_an_uploaded_model_loads_from_its_directory_and_leaves_with_it(repo, root):
    h = harness(repo, root)
    path = upload(root)
    load(h, "fresh", CONFIG, path)
    (sid,) = h.waiting()
    assert h.port.spawned[sid].model_dir == path
    h.ready(sid)
    assert h.replies()[-1].error == "" and h.states("fresh")[1][0] is ModelState.READY
    assert os.path.isdir(path)
    unload(h, "fresh")
    assert h.to_worker(Shutdown) == [(sid, Shutdown())]
    assert not os.path.exists(path)
    # a model that only came from an upload is not in the repository index any more, as Triton
    assert "fresh" not in names(h) and "plain" in names(h)


def test_an_upload_replaces_a_repository_model_until_a_plain_load(repo, root):
    h = harness(repo, root, load_models=["plain"])
    (old,) = h.spawn_ids("plain")
    path = upload(root, versions=(3,))
    load(h, "plain", CONFIG, path)
    (new,) = h.waiting()
    h.ready(new)
    assert h.port.spawned[new].model_dir == path and h.port.spawned[new].version == 3
    assert set(h.states("plain")) == {1, 3}                 # 1 drained, 3 serves
    assert h.states("plain")[3][0] is ModelState.READY
    assert (old, Shutdown()) in h.to_worker(Shutdown)
    load(h, "plain")                                          # back to the repository's copy
    (back,) = h.waiting()
    assert h.port.spawned[back].model_dir == os.path.join(repo, "plain")
    assert os.path.isdir(path)                                # still serving until then
    h.ready(back)
    assert h.states("plain")[1][0] is ModelState.READY
    assert not os.path.exists(path) and "plain" in names(h)


def test_unloading_an_uploaded_repository_model_leaves_the_repository_model(repo, root):
    h = harness(repo, root, load_models=["plain"])
    path = upload(root)
    load(h, "plain", CONFIG, path)
    h.ready_all()
    unload(h, "plain")
    assert not os.path.exists(path)
    assert h.states("plain") == {1: (ModelState.UNAVAILABLE, "unloaded", StateCause.UNLOADED)}
    load(h, "plain")
    (sid,) = h.waiting()
    assert h.port.spawned[sid].model_dir == os.path.join(repo, "plain")


def test_a_second_upload_replaces_the_first_directory(repo, root):
    h = harness(repo, root)
    first, second = upload(root), upload(root)
    load(h, "fresh", CONFIG, first)
    h.ready_all()
    load(h, "fresh", CONFIG, second)
    h.ready_all()
    assert not os.path.exists(first) and os.path.isdir(second)
    assert h.states("fresh")[1][0] is ModelState.READY


def test_a_failed_upload_is_removed_and_the_old_version_keeps_serving(repo, root):
    h = harness(repo, root, load_models=["plain"])
    (old,) = h.spawn_ids("plain")
    path = upload(root)
    load(h, "plain", CONFIG, path)
    (new,) = h.waiting()
    h.load_failed(new, "ImportError: no module named nope")
    assert h.replies()[-1].code is ErrorCode.INVALID_ARG
    assert not os.path.exists(path)
    assert h.states("plain")[1][0] is ModelState.READY and old not in h.port.killed
    # a new name that fails to load stays out of the index
    path = upload(root)
    load(h, "fresh", CONFIG, path)
    (fresh,) = h.spawn_ids("fresh")
    h.load_failed(fresh, "ImportError: no module named nope")
    assert not os.path.exists(path) and "fresh" not in names(h)


@pytest.mark.parametrize("config, text", [
    ("{not json", "failed to load 'fresh'"),
    ("", "need the 'config' load parameter"),
])
def test_a_refused_upload_is_removed_at_once(repo, root, config, text):
    h = harness(repo, root)
    path = upload(root)
    load(h, "fresh", config, path)
    assert h.replies()[-1].code is ErrorCode.INVALID_ARG and text in h.replies()[-1].error
    assert not os.path.exists(path) and h.port.spawned == {} and "fresh" not in names(h)


def test_an_upload_without_a_version_directory_is_refused(repo, root):
    h = harness(repo, root)
    path = upload(root, versions=())
    load(h, "fresh", CONFIG, path)
    assert "has no version directory" in h.replies()[-1].error
    assert not os.path.exists(path)


def test_an_upload_that_joins_a_load_in_progress_is_removed(repo, root):
    h = harness(repo, root)
    first, second = upload(root), upload(root)
    load(h, "fresh", CONFIG, first)
    load(h, "fresh", CONFIG, second)            # the same load answers both
    assert not os.path.exists(second) and os.path.isdir(first)
    h.ready_all()
    assert [r.error for r in h.replies()] == ["", ""]


def test_uploads_outside_explicit_mode_are_refused_and_removed(repo, root):
    h = harness(repo, root, model_control_mode="none")
    path = upload(root)
    load(h, "fresh", CONFIG, path)
    assert h.replies()[-1].code is ErrorCode.UNAVAILABLE
    assert not os.path.exists(path)


def test_a_directory_that_is_not_an_upload_is_never_touched(repo, root, tmp_path):
    h = harness(repo, root)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "1").mkdir(parents=True)
    nested = os.path.join(upload(root), "1")
    link = os.path.join(root, "link")
    os.symlink(str(elsewhere), link)
    for path in (str(elsewhere), nested, link, os.path.join(repo, "plain")):
        load(h, "fresh", CONFIG, path)
        assert h.replies()[-1].code is ErrorCode.INVALID_ARG
        assert "not one of this server's" in h.replies()[-1].error
        assert os.path.isdir(path)
    assert h.port.spawned == {}
    # without an upload directory (a server started some other way) nothing is adopted
    bare = Harness(repo, model_control_mode="explicit").start()
    path = upload(root)
    load(bare, "fresh", CONFIG, path)
    assert bare.replies()[-1].code is ErrorCode.INVALID_ARG and os.path.isdir(path)
