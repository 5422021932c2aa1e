"""The fault-injection soak (tools/soak.py) passes for 30 s with client and owner kills,
client freezes and a reconnect loop, and beside hostile clients (tools/soak_hostile.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_soak_with_kills_freezes_and_reconnects_keeps_every_invariant():
    seconds = os.environ.get("KVSHM_SOAK_SECONDS", "30")
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "soak.py"), "--seconds", seconds,
         "--kill-owner", "--reconnectors", "1", "--max-freeze", "1.5", "--json"],
        capture_output=True, text=True, timeout=300)
    assert out.stdout, f"the soak printed no report (exit {out.returncode}):\n{out.stderr[-4000:]}"
    report = json.loads(out.stdout)
    diag = json.dumps({k: report[k] for k in ("wedge_detail", "leaked_slot_detail",
                                              "corrupt_detail", "error_samples")},
                      indent=1) + "\n" + out.stderr[-4000:]
    assert report["corrupt_loads"] == 0, diag
    assert report["leaked_blocks"] == 0, diag
    assert report["leaked_slots"] == 0, diag
    assert report["wedges"] == 0, diag
    assert report["client_errors"] == 0, diag
    assert report["client_crashes"] == 0, diag
    assert report["violations"] == [], diag
    assert report["kills"]["clients"] > 0 and report["kills"]["owner"] > 0
    assert report["freezes"] > 0
    assert report["reconnects"] > 0
    assert report["loaded_blocks"] > 0
    assert out.returncode == 0 and report["ok"], diag


def test_soak_beside_hostile_clients_keeps_every_invariant():
    # Hostile clients flood the cache and scribble on their own slot, holds, rings, grant
    # counts and want ring, with owner kills as well: the honest clients, the owner and the
    # mover must notice nothing but a slower cache.
    seconds = os.environ.get("KVSHM_SOAK_SECONDS", "30")
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "soak.py"), "--seconds", seconds,
         "--kill-owner", "--hostile", "2", "--json"],
        capture_output=True, text=True, timeout=300)
    assert out.stdout, f"the soak printed no report (exit {out.returncode}):\n{out.stderr[-4000:]}"
    report = json.loads(out.stdout)
    diag = json.dumps(report, indent=1) + "\n" + out.stderr[-4000:]
    assert report["corrupt_loads"] == 0, diag
    assert report["leaked_blocks"] == 0 and report["leaked_slots"] == 0, diag
    assert report["wedges"] == 0, diag
    assert report["client_errors"] == 0 and report["client_crashes"] == 0, diag
    assert report["owner_deaths_not_killed"] == 0, diag
    assert report["mover"]["crashes"] == 0 and report["mover"]["busy_windows"] == 0, diag
    assert report["violations"] == [], diag
    assert report["hostile"]["actions"] > 0 and report["loaded_blocks"] > 0, diag
    assert out.returncode == 0 and report["ok"], diag


def test_the_soak_reports_a_slot_left_taken_by_its_record(seg_name):
    """What the soak says of a slot nobody gave back: read from the slot record, whatever
    fields the record has."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import soak
    from conftest import TEST_LAYOUT, stop_owner
    from kvshm.client.connect import connect
    mgr = connect(seg_name, TEST_LAYOUT, num_blocks=8)
    try:
        detail = soak.slot_detail(mgr.segment, [mgr.slot])
        assert detail == [{"slot": mgr.slot, "state": "client", "pid": os.getpid(),
                           "gen": mgr.gen, "name": detail[0]["name"]}]
    finally:
        pid = mgr.segment.owner_record()[0]
        mgr.shutdown()
        stop_owner(pid)


def test_a_frozen_client_that_died_meanwhile_is_thawed_without_ending_the_soak():
    """A hostile client may leave on its own just as it is frozen; starting the next client
    process reaps it (multiprocessing reaps finished children then), and the SIGCONT that
    ends its freeze found no process: the soak died printing no report."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import soak
    s = soak.Soak(soak.parser().parse_args([]))
    gone = s.ctx.Process(target=int)  # exits at once
    gone.start()
    gone.join()  # reaped: its pid names nobody now
    parent, child = s.ctx.Pipe()
    child.close()
    s.procs[0] = soak.Proc("hostile", gone, parent, time.monotonic(), frozen_until=0.0)
    s.thaw(time.monotonic())
    assert s.procs[0].frozen_until is None
    parent.close()
