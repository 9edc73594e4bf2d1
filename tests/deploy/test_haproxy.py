"""Three shmserve hosts behind the real HAProxy, with configs/haproxy/haproxy.cfg as shipped:
spread, affinity, failover, rejoin and drain (tests/deploy/lab_haproxy.py), run inside a network
namespace made for it (tests/netlab.py), so its addresses never touch the machine's network."""
from __future__ import annotations

import os
import subprocess
import sys

import netlab
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def test_haproxy_config_is_valid():
    if netlab.unavailable().startswith("haproxy"):
        pytest.skip(netlab.unavailable())
    r = subprocess.run(["haproxy", "-c", "-f", netlab.HAPROXY_CFG], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[WARNING]" not in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.timeout(600)
def test_three_hosts_behind_haproxy():
    why = netlab.unavailable()
    if why:
        pytest.skip(why)
    r = netlab.in_lab([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o",
                       "addopts=", "-q", "-s", "-x", "--timeout", "300",
                       os.path.join(HERE, "lab_haproxy.py")], timeout=480,
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                      cwd=os.path.dirname(HERE))
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-6000:]
