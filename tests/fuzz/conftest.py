"""Property-based fuzzing (hypothesis) of everything that parses what a client or a repository
sends. The "ci" profile runs in about a minute as part of the test suite; a long run is

    HYPOTHESIS_PROFILE=long python3 -m pytest tests/fuzz --timeout=0   # 100x the examples

The property is always the same: any input is either accepted or refused with the module's own
error type (a 4xx with a message), never another exception, a hang or a 5xx.
"""
import os
import sys

from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "frontend"))

settings.register_profile("ci", max_examples=300, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=30_000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
