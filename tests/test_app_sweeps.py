"""The Sweeps tab as a user drives it (gradio_client against `python app.py`): run, results, resume."""

from __future__ import annotations

import json

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


def test_the_family_sweep_shows_the_papers_table(client):
    """The shipped family sweep (`7-family.yaml`, assets:demo3): each language's expert set scored on its own
    language, shown as one row per model with a column per language and their average."""
    status, table, p0, *_ = client.predict("7-family.yaml", "", "", 1, api_name="/sweep")
    table = shown(table)
    assert "51 points in the results file" in status and "finished" in status  # 3 languages x (2 experts + 15)
    heads, rows = table["headers"], table["data"]
    assert {"qa", "qb", "qc", "average", "family"} <= set(heads) and len(rows) == 17
    col = heads.index("recipe")
    assert [r[col] for r in rows[:5]] == ["math expert", "language expert", "soup 50/50", "task arithmetic", "TIES"]
    assert all(r[heads.index("average")] is not None for r in rows)  # every language in: the average is given
    assert len(json.loads(shown(p0)["plot"])["data"]) == 3  # the (b, u) heatmap: a panel per language
