"""An ensemble whose step is a sequence model: the request's sequence id and flags reach the
step (Triton forwards request metadata to the steps), so the step's sequence batcher routes
it; without an id the step refuses it, and the error names the step."""
import os
import shutil

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from serverproc import REPO_ROOT, Server
from tritonclient.utils import InferenceServerException

ENSEMBLE = '''
name: "ens_seq"
platform: "ensemble"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "SUM", data_type: TYPE_INT32, dims: [ 1 ] } ]
ensemble_scheduling { step [ { model_name: "sequence_accumulator" model_version: -1
  input_map { key: "INPUT" value: "X" } output_map { key: "OUTPUT" value: "SUM" } } ] }
'''


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("ens_seq_repo"))
    shutil.copytree(os.path.join(REPO_ROOT, "configs", "models", "sequence_accumulator"),
                    os.path.join(repo, "sequence_accumulator"))
    os.makedirs(os.path.join(repo, "ens_seq", "1"))
    with open(os.path.join(repo, "ens_seq", "config.pbtxt"), "w") as f:
        f.write(ENSEMBLE)
    s = Server(repo)
    yield s
    assert s.stop() == 0


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_sequence_runs_through_an_ensemble(srv, protocol):
    mod = httpclient if protocol == "http" else grpcclient
    c = mod.InferenceServerClient(srv.url if protocol == "http" else srv.grpc_url)
    sums = {}
    values = [5, 1, 2, 3]
    for k, v in enumerate(values):                  # two sequences, interleaved
        for sid, scale in ((101, 1), ("s-102", 10)):
            i = mod.InferInput("X", [1, 1], "INT32")
            i.set_data_from_numpy(np.array([[v * scale]], np.int32))
            r = c.infer("ens_seq", [i], sequence_id=sid, sequence_start=k == 0,
                        sequence_end=k == len(values) - 1)
            sums.setdefault(sid, []).append(int(r.as_numpy("SUM")[0][0]))
    assert sums[101] == [5, 6, 8, 11]
    assert sums["s-102"] == [50, 60, 80, 110]
    i = mod.InferInput("X", [1, 1], "INT32")
    i.set_data_from_numpy(np.array([[1]], np.int32))
    with pytest.raises(InferenceServerException,
                       match=r"in ensemble 'ens_seq', step 0 \(model 'sequence_accumulator'\): "
                             r"inference request to model 'sequence_accumulator' must specify a "
                             r"non-zero or non-empty correlation ID"):
        c.infer("ens_seq", [i])
