"""The classification extension's pure parts (workers/classification.py): top-K per batch item,
Triton's string format, clamping, ties and NaN, datatypes, and reading label files."""
import numpy as np
import pytest

from shmserve.ipc.model_files import LabelFileError, read_labels
from shmserve.workers.classification import MAX_ELEMENTS, ClassificationError, classify


def _expected(row: np.ndarray, k: int, labels=()) -> list[bytes]:
    """Independent of the implementation: sort (value desc, index asc) in plain Python."""
    pairs = sorted(enumerate(row.tolist()), key=lambda p: (-p[1], p[0]))[:k]
    out = []
    for i, v in pairs:
        s = (f"{v:f}" if isinstance(v, float) else str(v)) + f":{i}"
        if i < len(labels) and labels[i]:
            s += ":" + labels[i].decode()
        out.append(s.encode())
    return out


def test_batched_top_k_per_item_against_numpy():
    rng = np.random.default_rng(7)
    arr = rng.standard_normal((4, 50)).astype(np.float32)
    got = classify(arr, "FP32", 5, batching=True)
    assert got.shape == (4, 5) and got.dtype == object
    for b in range(4):
        assert got[b].tolist() == _expected(arr[b], 5)
        idx = [int(s.split(b":")[1]) for s in got[b]]
        assert idx == np.argsort(-arr[b])[:5].tolist()


def test_value_format_is_cpp_to_string():
    # std::to_string(float) prints "%f": six decimals, no exponent
    arr = np.array([[15.34623, 1e-7, -2.5, 123456.0]], dtype=np.float32)
    got = classify(arr, "FP32", 4, batching=True)[0].tolist()
    assert got == [b"123456.000000:3", b"15.346230:0", b"0.000000:1", b"-2.500000:2"]
    ints = np.array([[7, -3, 200]], dtype=np.int64)
    assert classify(ints, "INT64", 2, True)[0].tolist() == [b"200:2", b"7:0"]
    u8 = np.array([[0, 255, 9]], dtype=np.uint8)
    assert classify(u8, "UINT8", 3, True)[0].tolist() == [b"255:1", b"9:2", b"0:0"]
    big = np.array([2 ** 64 - 1, 1], dtype=np.uint64)
    assert classify(big, "UINT64", 1, False).tolist() == [b"18446744073709551615:0"]


def test_labels_are_appended_by_index_and_empty_or_missing_ones_omitted():
    arr = np.array([[0.1, 0.4, 0.3, 0.2]], dtype=np.float64)
    labels = [b"zero", b"one", b""]           # index 2 has an empty line, index 3 no line
    got = classify(arr, "FP64", 4, True, labels)[0].tolist()
    assert got == [b"0.400000:1:one", b"0.300000:2", b"0.200000:3", b"0.100000:0:zero"]


def test_not_batched_ranks_the_whole_tensor():
    arr = np.array([[1, 5], [3, 4]], dtype=np.int32)
    got = classify(arr, "INT32", 3, batching=False)
    assert got.shape == (3,)
    assert got.tolist() == [b"5:1", b"4:3", b"3:2"]


@pytest.mark.parametrize("k", [12, 13, 1 << 40])
def test_k_is_clamped_to_the_entries_per_item(k):
    arr = np.arange(24, dtype=np.float32).reshape(2, 12)
    got = classify(arr, "FP32", k, True)
    assert got.shape == (2, 12)
    assert got[1].tolist() == _expected(arr[1], 12)


def test_item_with_several_dims_is_flattened():
    arr = np.arange(12, dtype=np.int16).reshape(2, 3, 2)
    got = classify(arr, "INT16", 2, True)
    assert got.tolist() == [[b"5:5", b"4:4"], [b"11:5", b"10:4"]]


def test_ties_keep_index_order_and_nan_ranks_last():
    arr = np.array([[0.5, np.nan, 0.5, 1.0, 0.5]], dtype=np.float32)
    got = classify(arr, "FP32", 5, True)[0].tolist()
    assert got == [b"1.000000:3", b"0.500000:0", b"0.500000:2", b"0.500000:4", b"nan:1"]


def test_empty_tensors():
    assert classify(np.zeros((0, 4), np.float32), "FP32", 2, True).shape == (0, 2)
    assert classify(np.zeros((3, 0), np.float32), "FP32", 2, True).shape == (3, 0)
    assert classify(np.zeros(0, np.float32), "FP32", 2, False).shape == (0,)


@pytest.mark.parametrize("datatype", ["BYTES", "BOOL", "FP16", "BF16"])
def test_unsupported_datatypes_get_tritons_words(datatype):
    with pytest.raises(ClassificationError, match=f"class result not available for output due "
                                                  f"to unsupported type '{datatype}'"):
        classify(np.zeros((1, 2), np.float32), datatype, 1, True)


def test_too_many_entries_per_item():
    with pytest.raises(ClassificationError, match="classification output tensor too large"):
        classify(np.zeros(MAX_ELEMENTS + 1, np.uint8), "UINT8", 1, False)


def test_read_labels(tmp_path):
    (tmp_path / "labels.txt").write_bytes(b"cat\ndog\r\n\nbird")    # no newline after the last
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "l.txt").write_bytes(b"a\nb\n")
    config = {"name": "m", "output": [
        {"name": "P", "label_filename": "labels.txt"},
        {"name": "Q", "label_filename": "sub/l.txt"},
        {"name": "R"}]}
    labels = read_labels(config, str(tmp_path))
    # one label a line, as Triton reads them (a CR stays: the file's own bytes)
    assert labels == {"P": [b"cat", b"dog\r", b"", b"bird"], "Q": [b"a", b"b"]}


@pytest.mark.parametrize("filename", ["../outside.txt", "/etc/hostname", "sub/../../x.txt"])
def test_label_file_outside_the_model_directory_is_refused(tmp_path, filename):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (tmp_path / "outside.txt").write_text("x\n")
    config = {"name": "m", "output": [{"name": "P", "label_filename": filename}]}
    with pytest.raises(LabelFileError, match="for output 'P' in model 'm' is outside the model "
                                             "directory"):
        read_labels(config, str(model_dir))


def test_missing_label_file_names_the_output(tmp_path):
    config = {"name": "m", "output": [{"name": "P", "label_filename": "nope.txt"}]}
    with pytest.raises(LabelFileError, match="unable to read the label file .*nope.txt' for "
                                             "output 'P'"):
        read_labels(config, str(tmp_path))
