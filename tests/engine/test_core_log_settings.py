"""SchedulerCore and the logging (and trace) extensions: a change a client made at a frontend reaches the
scheduler itself, every connected worker, the other frontends and workers that connect later;
the frontend that sent it hears it is done."""
import pytest
from fakes import IO, ONE, TWO, Harness, write_model

from shmserve.ipc.messages.common import LogFormat, LogSettings, TraceChanges
from shmserve.ipc.messages.to_frontend import ControlReply
from shmserve.ipc.messages.to_scheduler import FrontendHello, SetLogSettings, SetTraceSettings

FRONTEND = 0


@pytest.fixture
def repo(tmp_path):
    r = str(tmp_path / "models")
    write_model(r, "plain", f"max_batch_size: 8\n{IO}\n{ONE}")
    write_model(r, "pair", f"max_batch_size: 8\n{IO}\n{TWO}")
    return r


def test_a_change_reaches_every_process(repo):
    h = Harness(repo).start()
    h.core.handle(FrontendHello(1, "inproc://frontend-1"))
    workers = set(h.port.connected)
    assert len(workers) == 3
    new = LogSettings(info=False, verbose=2, format=LogFormat.ISO8601)
    h.core.handle(SetLogSettings(new, FRONTEND, 7))
    assert h.port.log_settings == new                       # the scheduler's own
    assert {sid for sid, m in h.to_worker(SetLogSettings) if m.settings == new} == workers
    to_frontends = [(f, m) for f, m in h.port.to_frontend if isinstance(m, (SetLogSettings, ControlReply))]
    # the other frontend gets the settings; the sender only its answer
    assert to_frontends == [(1, SetLogSettings(new)), (FRONTEND, ControlReply(7))]


def test_a_worker_that_connects_later_gets_the_change(repo):
    h = Harness(repo).start(ready=False)
    first = h.waiting()
    h.ready(first[0])
    new = LogSettings(verbose=1)
    h.core.handle(SetLogSettings(new, FRONTEND, 1))
    assert [sid for sid, _ in h.to_worker(SetLogSettings)] == [first[0]]
    h.ready_all()                           # these were loading while the change went out
    got = {sid for sid, m in h.to_worker(SetLogSettings) if m.settings == new}
    assert got == set(h.port.connected)


def test_no_change_no_message(repo):
    h = Harness(repo).start()
    assert not h.to_worker(SetLogSettings) and h.port.log_settings is None


def test_a_trace_change_reaches_the_other_frontends_only(repo):
    """Trace settings live in the frontends (frontend/observability/trace.py): workers are not told."""
    h = Harness(repo).start()
    h.core.handle(FrontendHello(1, "inproc://frontend-1"))
    h.core.handle(FrontendHello(2, "inproc://frontend-2"))
    changes = TraceChanges(level=["TIMESTAMPS"], rate=5)
    h.core.handle(SetTraceSettings(changes, "plain", FRONTEND, 9))
    to_frontends = [(f, m) for f, m in h.port.to_frontend
                    if isinstance(m, (SetTraceSettings, ControlReply))]
    assert to_frontends == [(1, SetTraceSettings(changes, "plain")),
                            (2, SetTraceSettings(changes, "plain")), (FRONTEND, ControlReply(9))]
    assert not h.to_worker(SetTraceSettings)


def test_a_frontend_that_comes_later_gets_what_clients_changed_before(repo):
    h = Harness(repo).start()
    new = LogSettings(verbose=1)
    h.core.handle(SetLogSettings(new, FRONTEND, 1))
    h.core.handle(SetTraceSettings(TraceChanges(rate=5, count=3), "", FRONTEND, 2))
    h.core.handle(SetTraceSettings(TraceChanges(level=["TIMESTAMPS"]), "plain", FRONTEND, 3))
    h.core.handle(SetTraceSettings(TraceChanges(rate=None), "", FRONTEND, 4))
    h.core.handle(FrontendHello(1, "inproc://frontend-1"))
    late = [m for f, m in h.port.to_frontend
            if f == 1 and isinstance(m, (SetLogSettings, SetTraceSettings))]
    # per model, the last value each setting was given (None: set back), the global ones first
    assert late == [SetLogSettings(new), SetTraceSettings(TraceChanges(rate=None, count=3), ""),
                    SetTraceSettings(TraceChanges(level=["TIMESTAMPS"]), "plain")]
