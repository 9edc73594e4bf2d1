"""engine/lifecycle/startup_report.py: the lines an operator reads while models load."""
from shmserve.engine.lifecycle.startup_report import FIRST_REPORT_S, SlowLoads, status_table
from shmserve.ipc.messages.common import ModelState
from shmserve.ipc.messages.to_frontend import ModelInfo, VersionInfo


def test_a_slow_load_is_reported_at_5_10_20_s_and_a_quick_one_never():
    s = SlowLoads()
    said = []
    t = 0.0
    while t < 45:
        wait, lines = s.due({"big": 0.0, "quick": 0.0} if t < 1 else {"big": 0.0}, t)
        said += [(round(t), line) for line in lines]
        assert 0 < wait <= 1.0
        t += wait
    assert [line for _, line in said] == [
        f"model 'big' is still loading ({n} s so far)" for n in (5, 10, 20, 40)]
    assert [at for at, _ in said] == [5, 10, 20, 40]


def test_a_finished_load_is_forgotten_and_a_new_one_starts_afresh():
    s = SlowLoads()
    assert s.due({"m": 0.0}, FIRST_REPORT_S)[1]
    assert s.due({}, 7.0) == (1.0, [])
    assert s.due({"m": 7.0}, 8.0)[1] == []                  # loading again: 1 s in
    assert s.due({"m": 7.0}, 7.0 + FIRST_REPORT_S)[1]


def test_the_status_table_has_every_version_and_the_reason_of_one_not_ready():
    text = status_table([
        ModelInfo("simple", b"", [VersionInfo(1, ModelState.READY),
                                  VersionInfo(2, ModelState.LOADING)]),
        ModelInfo("broken", b"", [VersionInfo(-1, ModelState.UNAVAILABLE,
                                              "failed to load 'broken': no model file")])])
    lines = text.splitlines()
    assert lines[0] == lines[2] == lines[-1] and set(lines[0]) == {"+", "-"}
    assert [c.strip() for c in lines[1].split("|")[1:4]] == ["Model", "Version", "Status"]
    assert [[c.strip() for c in row.split("|")[1:4]] for row in lines[3:-1]] == [
        ["simple", "1", "READY"], ["simple", "2", "LOADING"],
        ["broken", "-", "UNAVAILABLE: failed to load 'broken': no model file"]]
    assert len({len(line) for line in lines}) == 1
