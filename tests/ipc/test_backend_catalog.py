"""ipc/backend_catalog.py: the one lookup of a backend name, in-process."""
import os

import pytest

from shmserve.ipc.backend_catalog import SHIPPED_DIRECTORY, BackendCatalog, BackendNotFound


def _backend(root, name: str) -> str:
    os.makedirs(os.path.join(root, name), exist_ok=True)
    path = os.path.join(root, name, "model.py")
    with open(path, "w") as f:
        f.write("class TritonPythonModel: pass\n")
    return path


def test_built_in_first_then_the_users_directory_then_the_shipped_one_then_plug_ins(tmp_path):
    mine = _backend(tmp_path, "mine")
    _backend(tmp_path, "python")        # a folder cannot take a built-in's name
    overriding = _backend(tmp_path, "expression")
    catalog = BackendCatalog([str(tmp_path)], plugins={"scale": "pkg:Scale", "mine": "pkg:Mine"})
    assert catalog.find("python").kind == "built-in"
    assert catalog.find("onnxruntime").platform == "onnxruntime_onnx"
    assert catalog.find("mine").source == mine and catalog.find("mine").decoupled
    assert catalog.find("expression").source == overriding
    assert catalog.find("scale").kind == "plug-in" and catalog.find("scale").source == "pkg:Scale"
    assert not catalog.find("scale").decoupled
    shipped = BackendCatalog(plugins={}).find("expression")
    assert shipped.source == os.path.join(SHIPPED_DIRECTORY, "expression", "model.py")
    assert catalog.directories == [str(tmp_path), SHIPPED_DIRECTORY]


@pytest.mark.parametrize("name", ["..", ".", "../x", "a/b", "a\\b", "", "x\0y"])
def test_a_name_is_one_path_component(tmp_path, name):
    _backend(tmp_path / "inner", "x")       # tmp_path/inner/x/model.py: reachable as ../x?
    with pytest.raises(BackendNotFound):
        BackendCatalog([str(tmp_path / "inner" / "x")], plugins={}).find(name)


def test_not_found_names_what_exists_and_where_it_looked(tmp_path):
    _backend(tmp_path, "mine")
    with pytest.raises(BackendNotFound) as e:
        BackendCatalog([str(tmp_path)], plugins={"scale": "pkg:Scale"}).find("nosuch")
    text = str(e.value)
    assert text.startswith("unable to find backend library for backend 'nosuch', try specifying "
                           "runtime on the model configuration.")
    assert os.path.join(str(tmp_path), "nosuch", "model.py") in text
    assert os.path.join(SHIPPED_DIRECTORY, "nosuch", "model.py") in text
    assert "the backends that exist: expression, identity, mine, onnxruntime, python, repeat, " \
           "scale, square, tensorrt" in text


def test_a_folder_without_model_py_is_no_backend(tmp_path):
    os.makedirs(tmp_path / "empty")
    (tmp_path / "file").write_text("")
    catalog = BackendCatalog([str(tmp_path), str(tmp_path / "missing")], plugins={})
    assert "empty" not in catalog.names()
    with pytest.raises(BackendNotFound):
        catalog.find("empty")
