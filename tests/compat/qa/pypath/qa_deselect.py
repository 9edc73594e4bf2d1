"""pytest plugin for run_triton_qa.py: deselects exactly the test ids listed in $QA_DESELECT
(one ``Class.test`` per line). pytest's own --deselect matches node-id prefixes, which would
also drop test_x_stream along with test_x."""
import os


def pytest_collection_modifyitems(config, items):
    wanted = {line.strip() for line in os.environ.get("QA_DESELECT", "").splitlines() if line.strip()}
    if not wanted:
        return
    keep, drop = [], []
    for item in items:
        cls = item.cls.__name__ if item.cls else ""
        key = f"{cls}.{item.name}" if cls else item.name
        (drop if key in wanted or item.name in wanted else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
