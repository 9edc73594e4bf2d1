"""--frontends: a count, or auto from the CPUs this process may run on."""
import argparse
import os

import pytest

from shmserve.engine.launch.cli import frontend_count, parse_settings


def test_auto_is_one_up_to_four_cpus_then_a_quarter_at_most_eight(monkeypatch):
    for cpus, want in ((1, 1), (2, 1), (4, 1), (8, 2), (16, 4), (32, 8), (128, 8)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        assert frontend_count("auto") == want


def test_a_count_is_taken_as_given_and_checked():
    assert frontend_count("3") == 3
    for bad in ("0", "65", "two", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            frontend_count(bad)


def test_the_setting_reaches_the_processes(tmp_path):
    settings, _ = parse_settings(["--model-repository", str(tmp_path), "--frontends", "2"])
    assert settings.frontends == 2
    settings, _ = parse_settings(["--model-repository", str(tmp_path)])
    assert settings.frontends == frontend_count("auto")
