"""The Sweeps tab as a user drives it (gradio_client against `python app.py`): run, results, resume."""

from __future__ import annotations

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from tests.helpers import shown


@pytest.fixture(scope="module")
def client(app_url):
    return Client(app_url, verbose=False)


def test_run_shows_table_and_plots_and_a_rerun_resumes(client):
    status, table, p0, p1, p2, files = client.predict("2-transition.yaml", "", "", 1, api_name="/sweep")
    table = shown(table)
    n = len(table["data"])
    assert status.startswith("**2 ") and f"{n} points in the results file" in status and "finished" in status
    col = table["headers"].index("recipe")
    assert n == 10 and {"math expert", "language expert", "t=2 ramp"} <= {r[col] for r in table["data"]}
    assert shown(p0)["plot"]
    assert len(shown(files)) == 2  # CSV and HTML
    again, table2, *_ = client.predict("2-transition.yaml", "", "", 1, api_name="/sweep")
    assert "0 computed now" in again and shown(table2)["data"] == table["data"]  # every point was in the file
    seen, table3, *_ = client.predict("2-transition.yaml", "", "", 1, api_name="/sweep_results")
    assert shown(table3)["data"] == table["data"]


def test_bad_sweep_file(client):
    with pytest.raises(AppError, match="no such sweep file"):
        client.predict("1-counts.yaml", "/nonexistent/sweep.yaml", "", 1, api_name="/sweep")
