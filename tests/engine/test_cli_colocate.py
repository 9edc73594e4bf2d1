"""--colocate and --colocate-max-gap-us reach the processes; a bad gap is refused by name."""
import subprocess
import sys

from shmserve.engine.launch.cli import parse_settings


def test_the_settings_reach_the_processes(tmp_path):
    settings, _ = parse_settings(["--model-repository", str(tmp_path)])
    assert (settings.colocate, settings.colocate_max_gap_us) == ("auto", 1000)
    settings, _ = parse_settings(["--model-repository", str(tmp_path), "--colocate", "OFF",
                                  "--colocate-max-gap-us", "250"])
    assert (settings.colocate, settings.colocate_max_gap_us) == ("off", 250)


def test_a_bad_gap_or_mode_is_refused_with_the_flag_named(tmp_path):
    for args, words in ((["--colocate-max-gap-us", "-5"], "must be 0 or more, got -5"),
                        (["--colocate-max-gap-us", "1ms"], "expected a whole number"),
                        (["--colocate", "always"], "invalid choice: 'always'")):
        r = subprocess.run([sys.executable, "-m", "shmserve.engine.launch.cli", "--model-repository",
                            str(tmp_path), *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r
        assert args[0] in r.stderr and words in r.stderr, r.stderr
