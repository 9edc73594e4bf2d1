"""ModelRepository.scan over repositories written into tmp_path."""
import os

import pytest

from shmserve.engine.lifecycle.repository import ModelRepository, version_dirs
from shmserve.ipc import model_config
from shmserve.ipc.model_config import ConfigError

CONFIG = '''
backend: "python"
max_batch_size: {mbs}
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ 4 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] }} ]
{extra}
'''


def make_model(repo, name, versions=(1,), files=None, mbs=0, extra="", config=None):
    """A python model; ``files`` maps version -> model file name present (default model.py)."""
    files = files or {}
    mdir = repo / name
    mdir.mkdir(parents=True)
    (mdir / "config.pbtxt").write_text(config if config is not None else CONFIG.format(mbs=mbs, extra=extra))
    for v in versions:
        vdir = mdir / str(v)
        vdir.mkdir()
        fname = files.get(v, "model.py")
        if fname:
            (vdir / fname).write_text("")
    return mdir


def plans(entry):
    return [(p.version, p.error) for p in entry.versions]


def test_scan_finds_models_and_versions(tmp_path):
    make_model(tmp_path, "a", versions=(1, 2, 3), extra="version_policy { all { } }")
    make_model(tmp_path, "b", versions=(1, 2))
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "README").write_text("not a model")
    models = ModelRepository([str(tmp_path)]).scan()
    assert sorted(models) == ["a", "b"]
    a = models["a"]
    assert a.error == "" and a.config.name == "a" and a.path == str(tmp_path / "a")
    assert plans(a) == [(1, ""), (2, ""), (3, "")]
    assert [p.path for p in a.versions] == [str(tmp_path / "a" / str(v)) for v in (1, 2, 3)]
    assert plans(models["b"]) == [(2, "")]  # default policy: latest 1


def test_version_dirs_numeric_only_and_no_leading_zero(tmp_path):
    mdir = make_model(tmp_path, "m", versions=(0, 2, 10, "007", "01", "x1", "1a", "\u0661", "\u00b2"),
                      extra="version_policy { all { } }")
    (mdir / "3").write_text("a file, not a directory")
    assert version_dirs(str(mdir)) == [0, 2, 10]
    entry = ModelRepository([str(tmp_path)]).scan()["m"]
    assert entry.error == ""
    assert [p.version for p in entry.versions] == [0, 2, 10]


def test_missing_model_file_fails_that_version_only(tmp_path):
    make_model(tmp_path, "m", versions=(1, 2, 3), files={2: "other.py"},
               extra="version_policy { all { } }")
    entry = ModelRepository([str(tmp_path)]).scan()["m"]
    assert entry.error == ""
    assert [p.version for p in entry.versions] == [1, 2, 3]
    assert entry.versions[0].error == "" and entry.versions[2].error == ""
    assert entry.versions[1].error == ("Failed to preinitialize Python stub: Python model file "
                                       f"not found in '{tmp_path / 'm' / '2' / 'model.py'}'")


def test_default_model_filename_is_honoured(tmp_path):
    make_model(tmp_path, "m", versions=(1, 2), files={1: "custom.py", 2: "model.py"},
               extra='default_model_filename: "custom.py"\nversion_policy { all { } }')
    entry = ModelRepository([str(tmp_path)]).scan()["m"]
    assert entry.versions[0].error == ""
    assert "Python model file not found in" in entry.versions[1].error and "custom.py" in entry.versions[1].error


def test_no_version_directory(tmp_path):
    make_model(tmp_path, "m", versions=())
    entry = ModelRepository([str(tmp_path)]).scan()["m"]
    assert entry.error == f"model 'm' has no version directory (e.g. {tmp_path / 'm'}/1)"
    assert entry.versions == []


def test_specific_policy_with_missing_versions(tmp_path):
    make_model(tmp_path, "m", versions=(1, 2), extra="version_policy { specific { versions: [ 2, 5 ] } }")
    entry = ModelRepository([str(tmp_path)]).scan()["m"]
    assert entry.error == ""
    assert sorted(plans(entry)) == [
        (2, ""), (5, f"version 5 named by version_policy does not exist in {tmp_path / 'm'}")]
    assert {p.version: p.path for p in entry.versions} == {2: str(tmp_path / "m" / "2"), 5: ""}


def test_policy_selecting_nothing(tmp_path):
    make_model(tmp_path, "m", versions=(1,), extra="version_policy { specific { } }")
    entry = ModelRepository([str(tmp_path)]).scan()["m"]
    assert entry.error == "model 'm': version_policy selects no version"


def test_config_errors_are_per_model(tmp_path):
    make_model(tmp_path, "bad", config='backend: "python"\nmax_batch_size: [')
    make_model(tmp_path, "wrongname", extra='name: "other"')
    make_model(tmp_path, "noconfig")
    os.remove(tmp_path / "noconfig" / "config.pbtxt")
    make_model(tmp_path, "good")
    models = ModelRepository([str(tmp_path)], auto_complete=False).scan()
    assert models["bad"].error.startswith(f"failed to parse {tmp_path / 'bad' / 'config.pbtxt'}")
    assert models["bad"].config is None
    assert "does not match the directory name 'wrongname'" in models["wrongname"].error
    assert "model configuration is not provided" in models["noconfig"].error
    assert models["good"].error == "" and plans(models["good"]) == [(1, "")]


def test_config_less_models_get_their_backend_from_the_file(tmp_path):
    make_model(tmp_path, "py")
    os.remove(tmp_path / "py" / "config.pbtxt")
    os.makedirs(tmp_path / "nofile" / "1")
    models = ModelRepository([str(tmp_path)]).scan()
    assert models["py"].error == "" and models["py"].config.backend == "python"
    assert models["py"].config.name == "py"
    assert "model configuration is not provided" in models["nofile"].error
    # a config that fails to parse stays an error, model file or not
    make_model(tmp_path, "broken", config='backend: "python"\nmax_batch_size: eight')
    broken = ModelRepository([str(tmp_path)]).scan()["broken"]
    assert broken.error.startswith("failed to parse") and broken.config is None


def test_a_config_without_backend_gets_it_from_the_model_file(tmp_path):
    make_model(tmp_path, "py", config="max_batch_size: 16")
    override = model_config.ModelConfig(max_batch_size=4)
    repo = ModelRepository([str(tmp_path)])
    assert repo.scan()["py"].config.backend == "python"
    entry = repo.read_model("py", [str(tmp_path / "py")], override)
    assert entry.error == "" and entry.config.backend == "python"
    assert entry.config.max_batch_size == 4


def test_duplicate_model_across_repositories(tmp_path):
    r1, r2 = tmp_path / "r1", tmp_path / "r2"
    make_model(r1, "dup")
    make_model(r2, "dup")
    make_model(r1, "only1")
    make_model(r2, "only2")
    models = ModelRepository([str(r1), str(r2)]).scan()
    assert sorted(models) == ["dup", "only1", "only2"]
    dup = models["dup"]
    assert dup.error == (f"model 'dup' appears in more than one repository: "
                         f"{r1 / 'dup'}, {r2 / 'dup'}")
    assert dup.versions == [] and dup.config is None
    assert models["only1"].error == "" and models["only2"].error == ""
    assert models["only2"].path == str(r2 / "only2")


def test_config_name_selects_configs_dir(tmp_path):
    mdir = make_model(tmp_path, "m", mbs=8)
    (mdir / "configs").mkdir()
    (mdir / "configs" / "small.pbtxt").write_text(CONFIG.format(mbs=2, extra=""))
    make_model(tmp_path, "plain", mbs=4)
    models = ModelRepository([str(tmp_path)], config_name="small").scan()
    assert models["m"].config.max_batch_size == 2
    assert models["plain"].config.max_batch_size == 4  # no configs/small.pbtxt: config.pbtxt
    assert ModelRepository([str(tmp_path)]).scan()["m"].config.max_batch_size == 8


def test_gpu_count_reaches_normalize(tmp_path):
    make_model(tmp_path, "m", config='backend: "onnxruntime"\ninstance_group [ { kind: KIND_AUTO } ]\n'
                                     'input [ { name: "I", data_type: TYPE_FP32, dims: [ 1 ] } ]',
               files={1: "model.onnx"})
    entry = ModelRepository([str(tmp_path)], gpu_count=1).scan()["m"]
    assert entry.error == ""
    assert list(entry.config.instance_group[0].gpus) == [0]


def test_check_paths(tmp_path):
    ModelRepository([str(tmp_path)]).check_paths()
    with pytest.raises(ConfigError, match="is not a directory"):
        ModelRepository([str(tmp_path), str(tmp_path / "missing")]).check_paths()


def test_paths_are_absolute(tmp_path, monkeypatch):
    make_model(tmp_path, "m")
    monkeypatch.chdir(tmp_path.parent)
    repo = ModelRepository([tmp_path.name])
    assert repo.paths == [str(tmp_path)]
    assert repo.scan()["m"].path == str(tmp_path / "m")


def test_the_instance_bound_holds_over_all_the_versions_a_load_starts(tmp_path):
    """Each version runs its own instances: 200 version directories under version_policy all
    would start 200 processes of a one-instance model; refused with the fields named."""
    make_model(tmp_path, "many", versions=range(1, 201), extra="version_policy { all { } }")
    make_model(tmp_path, "fine", versions=range(1, 5),
               extra="version_policy { all { } }\ninstance_group [ { count: 32 } ]")
    found = ModelRepository([str(tmp_path)]).scan()
    assert found["many"].error == (
        f"model 'many': version_policy selects 200 versions of 1 instance(s) each "
        f"(instance_group), 200 worker processes, more than the limit of "
        f"{model_config.MAX_INSTANCES_PER_MODEL}")
    assert found["fine"].error == "" and len(found["fine"].versions) == 4


@pytest.mark.parametrize("kind", ["fifo", "directory", "loop", "device"])
def test_a_model_file_must_be_a_regular_file(tmp_path, kind):
    mdir = make_model(tmp_path, "m", files={1: ""})
    path = mdir / "1" / "model.py"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "loop":
        path.symlink_to("model.py")
    else:
        path.symlink_to("/dev/null")
    [(version, error)] = plans(ModelRepository([str(tmp_path)]).scan()["m"])
    assert error.startswith(f"model file {path} cannot be used: "), error


def test_an_onnx_model_may_be_a_directory_holding_model_onnx(tmp_path):
    mdir = make_model(tmp_path, "o", files={1: ""}, config='backend: "onnxruntime"\n')
    (mdir / "1" / "model.onnx").mkdir()
    assert plans(ModelRepository([str(tmp_path)]).scan()["o"]) == [
        (1, f"model file 'model.onnx' not found in {mdir / '1' / 'model.onnx'}")]
    (mdir / "1" / "model.onnx" / "model.onnx").write_bytes(b"")
    assert plans(ModelRepository([str(tmp_path)]).scan()["o"]) == [(1, "")]


def test_symlink_loops_in_a_repository_are_no_model_and_no_version(tmp_path):
    make_model(tmp_path, "m", versions=(1,))
    (tmp_path / "loop").symlink_to("loop")              # beside the models
    (tmp_path / "m" / "2").symlink_to("2")              # a version that loops
    (tmp_path / "m" / "stray").symlink_to("stray")      # any other file of the model
    found = ModelRepository([str(tmp_path)]).scan()
    assert list(found) == ["m"] and found["m"].error == "" and plans(found["m"]) == [(1, "")]


# ---- hints for a repository laid out wrongly ---------------------------------------------------

@pytest.mark.parametrize("filename", ["model.onnx", "model.py", "model.plan"])
def test_a_model_file_outside_any_version_directory_says_where_it_belongs(tmp_path, filename):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / filename).write_bytes(b"")
    [entry] = ModelRepository([str(tmp_path)]).scan().values()
    assert entry.error == (f"model 'm' has no version directory: {tmp_path}/m/{filename} is not "
                           f"in a version directory: a model's files live in numbered version "
                           f"directories, e.g. {tmp_path}/m/1/{filename}")


def test_a_config_without_any_version_directory_names_the_missing_directory(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text(CONFIG.format(mbs=0, extra=""))
    [entry] = ModelRepository([str(tmp_path)]).scan().values()
    assert entry.error == f"model 'm' has no version directory (e.g. {tmp_path}/m/1)"


def test_model_files_at_the_top_of_the_repository_get_a_hint_each(tmp_path):
    make_model(tmp_path, "fine")
    for name in ("model.onnx", "resnet50.onnx", "notes.txt", "model.py"):
        (tmp_path / name).write_bytes(b"")
    repo = ModelRepository([str(tmp_path)])
    hints = repo.misplaced_files()
    assert [h.split(" is a file")[0] for h in hints] == [
        f"{tmp_path}/model.onnx", f"{tmp_path}/model.py", f"{tmp_path}/resnet50.onnx"]
    assert hints[2].endswith(f"put it in {tmp_path}/<model name>/1/ (e.g. "
                             f"{tmp_path}/resnet50/1/model.onnx)")
    assert list(repo.scan()) == ["fine"] and repo.scan()["fine"].error == ""
