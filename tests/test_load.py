"""scripts/load_test.py with a few concurrent visitors: no error, no cross-visitor leak."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO


def test_concurrent_visitors_get_their_own_plans(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "load_test.py"), "--clients", "3", "--rounds", "1",
                        "--timeout", "600"], cwd=tmp_path, capture_output=True, text=True, timeout=700)
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert summary["errors"] == 0 and summary["leaks"] == 0 and summary["completed"] == 12
    assert summary["checked"] == 3
    assert summary["distinct_answers"] >= 2  # the plans answer differently, so a leak would have been seen
