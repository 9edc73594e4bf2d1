"""Run Triton's own QA suites (its ``qa/L0_*`` folders), unchanged, against shmserve.

tests/compat/run_triton_qa.py is the entry point. ``harness`` starts shmserve the way Triton's
``qa/common/util.sh`` starts tritonserver and records the verdicts; ``runners`` runs the suites'
unittest/pytest files case by case; ``models`` builds the model repositories each ``test.sh``
builds; each ``suite_*`` module replays one or more suites' ``test.sh``; ``report`` prints and
saves the verdicts. ``pypath/`` goes on the test processes' PYTHONPATH (a stand-in for
python_backend's compiled ``triton_shm_monitor`` and a pytest deselect plugin).
"""
