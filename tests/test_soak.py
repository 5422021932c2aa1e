"""The fault-injection soak (tools/soak.py) passes for 30 s with client and owner kills."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_soak_with_client_and_owner_kills_keeps_every_invariant():
    seconds = os.environ.get("KVSHM_SOAK_SECONDS", "30")
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "soak.py"), "--seconds", seconds,
         "--kill-owner", "--json"], capture_output=True, text=True, timeout=300)
    report = json.loads(out.stdout)
    assert report["corrupt_loads"] == 0
    assert report["leaked_blocks"] == 0
    assert report["client_crashes"] == 0
    assert report["violations"] == []
    assert report["kills"]["clients"] > 0 and report["kills"]["owner"] > 0
    assert report["loaded_blocks"] > 0
    assert out.returncode == 0 and report["ok"]
