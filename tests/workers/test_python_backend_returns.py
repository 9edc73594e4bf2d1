"""What a python model that is not decoupled may return from execute(), and what each request
gets: one answer, from the list or from its response sender, never none and never two. Triton's
words where Triton has them (python_backend src/pb_stub.cc)."""
import json

import numpy as np
import pytest
from serverproc import wait_for

from shmserve.ipc.messages.common import ErrorCode
from shmserve.ipc.spawn_args import InstanceSpec
from shmserve.workers.backends.base import WorkRequest
from shmserve.workers.python_backend.backend import PythonBackend

PREFIX = "Failed to process the request(s) for model 'ret_0_0', message: "

MODEL = """
import os
import threading
import time
import numpy as np
import triton_python_backend_utils as pb_utils

def answer(r):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", r.inputs()[0].as_numpy())])

class TritonPythonModel:
    def execute(self, requests):
        how = RETURN
        if how == "none":
            return None
        if how == "dict":
            return {}
        if how == "short":
            return [answer(requests[0])]
        if how == "none_entry":
            return [answer(requests[0]), None]
        if how == "sender_then_none":
            for r in requests:
                r.get_response_sender().send(answer(r), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
        if how == "sender_first_then_list":
            requests[0].get_response_sender().send(answer(requests[0]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return [None, answer(requests[1])]
        if how == "sender_later":
            # Triton's response_sender QA model: takes the senders in execute(), answers from
            # a thread after execute() returned
            senders = [(r.get_response_sender(), answer(r)) for r in requests]

            def later():
                # once the test says execute() has returned (a file it makes), or 10 s
                deadline = time.monotonic() + 10
                while not os.path.exists(GO) and time.monotonic() < deadline:
                    time.sleep(0.01)
                for s, a in senders:
                    s.send(a, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            threading.Thread(target=later).start()
            return None
        if how == "sender_and_list":
            requests[0].get_response_sender().send(answer(requests[0]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return [answer(r) for r in requests]
"""


def _backend(tmp_path, how: str) -> PythonBackend:
    d = tmp_path / "ret" / "1"
    d.mkdir(parents=True)
    (d / "model.py").write_text(MODEL.replace("RETURN", repr(how))
                                .replace("GO", repr(str(tmp_path / "go"))))
    cfg = {"name": "ret", "backend": "python", "max_batch_size": 8,
           "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [1]}],
           "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [1]}]}
    return PythonBackend(InstanceSpec("ret", 1, str(tmp_path / "ret"), json.dumps(cfg),
                                      "ret_0_0", "CPU", 0, "python"))


def _run(tmp_path, how: str):
    """Two requests in one execution; returns (their answers from the return, what their
    response senders emitted)."""
    emitted: list[list] = [[], []]
    reqs = [WorkRequest({"IN": np.full((1, 1), i, np.float32)}, {"IN": "FP32"}, [],
                        emit=lambda resp, final, i=i: emitted[i].append((resp, final)))
            for i in range(2)]
    return _backend(tmp_path, how).execute(reqs), emitted


def _errors(answers) -> list[str]:
    return [a.error if a is not None else None for a in answers]


def test_none_from_a_model_that_is_not_decoupled_fails_each_request_at_once(tmp_path):
    answers, emitted = _run(tmp_path, "none")
    for a in answers:
        assert a.code == ErrorCode.INTERNAL
        assert a.error.startswith(PREFIX + "Expected a list in the execute return, found type "
                                           "'<class 'NoneType'>'.")
        assert "through the request's response sender" in a.error
    assert emitted == [[], []]


def test_a_return_that_is_not_a_list_fails_each_request(tmp_path):
    answers, _ = _run(tmp_path, "dict")
    assert _errors(answers) == [PREFIX + "Expected a list in the execute return, found type "
                                         "'<class 'dict'>'."] * 2


def test_a_list_of_the_wrong_length_fails_each_request(tmp_path):
    answers, _ = _run(tmp_path, "short")
    assert _errors(answers) == [
        PREFIX + "Number of InferenceResponse objects do not match the number of "
                 "InferenceRequest objects. InferenceRequest(s) size is:2, and "
                 "InferenceResponse(s) size is:1"] * 2


def test_none_in_the_list_for_a_request_nobody_answered_fails_that_request(tmp_path):
    answers, _ = _run(tmp_path, "none_entry")
    assert answers[0].error == "" and answers[0].outputs[0][2].tolist() == [[0.0]]
    assert answers[1].error.startswith(
        PREFIX + "Expected an 'InferenceResponse' object in the execute function return list, "
                 "found type '<class 'NoneType'>'.")


@pytest.mark.parametrize("how", ["sender_then_none", "sender_first_then_list"])
def test_requests_answered_through_their_senders_keep_that_one_answer(tmp_path, how):
    """Triton since 24.06: a model that is not decoupled may answer through the response
    sender and put None in the list (or return None) for those requests."""
    answers, emitted = _run(tmp_path, how)
    assert answers[0] is None and len(emitted[0]) == 1 and emitted[0][0][0].error == ""
    if how == "sender_then_none":
        assert answers[1] is None and len(emitted[1]) == 1
    else:
        assert answers[1].error == "" and emitted[1] == []


def test_a_request_whose_sender_the_model_took_may_be_answered_after_execute_returns(tmp_path):
    """Triton's test_non_decoupled_one_response_post_return: the sender, taken in execute(),
    answers from a thread once execute() has returned; nothing fails the request meanwhile."""
    answers, emitted = _run(tmp_path, "sender_later")
    assert answers == [None, None] and emitted == [[], []]
    (tmp_path / "go").touch()
    wait_for(lambda: all(emitted), 10, "the thread's answers")
    for e in emitted:
        assert len(e) == 1 and e[0][0].error == ""


def test_a_request_answered_through_its_sender_gets_no_second_answer_from_the_list(tmp_path):
    answers, emitted = _run(tmp_path, "sender_and_list")
    assert answers[0] is None and len(emitted[0]) == 1          # the sender's answer only
    assert answers[1].error == "" and emitted[1] == []
