"""Run Triton's own QA suites (its ``qa/L0_*`` folders), unchanged, against shmserve.

tests/compat/run_triton_qa.py is the entry point. ``harness`` starts shmserve the way Triton's
``qa/common/util.sh`` starts tritonserver and runs the suites' unittest/pytest files case by
case; ``models`` builds the model repositories each ``test.sh`` builds; one ``suite_*`` module
per Triton suite replays that suite's ``test.sh``.
"""
