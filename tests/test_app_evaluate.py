"""The Evaluate tab as a user drives it (gradio_client against `python app.py`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from layerswap.evaluation import mgsm
from tests.helpers import DEMO_MGSM, shown


@pytest.fixture(scope="module")
def client(app_url):
    c = Client(app_url, verbose=False)
    cfg = c.config
    values = {x.get("props", {}).get("elem_id"): x.get("props", {}).get("value") for x in cfg["components"]}
    report, *_ = c.predict(values["base"], values["math"], values["lang"], api_name="/load")
    assert "**Answers:** transformers, both experts in memory" in report  # which engine answers is on the page
    return c


def test_evaluate_three_models_table_bars_browser(client):
    status, table, bars, results, b_lang, b_pos, detail = client.predict(
        ["xx", "en"], ["math", "lang", "merged"], 3, 0, "native_cot", 16, api_name="/evaluate")
    table, bars = shown(table), shown(bars)
    assert status.startswith("**Done:** 18 answers") and "transformers" in status
    assert table["headers"][:4] == ["language", "n", "math expert (flexible)", "math expert (strict)"]
    rows = {r[0]: r for r in table["data"]}
    assert rows["max"][1] == rows["average"][1] == 6
    assert set(rows) == {"xx", "en", "average", "max"} and rows["xx"][1] == 3
    for col in range(2, 8):
        vals = [rows[c][col] for c in ("xx", "en")]
        assert all(v in (0, 33.3, 66.7, 100) for v in vals)
        assert rows["average"][col] == pytest.approx(sum(vals) / 2, abs=0.051) and rows["max"][col] == max(vals)
    fig = json.loads(bars["plot"])
    assert [t["name"] for t in fig["data"]] == ["math expert (reference)", "language expert (reference)", "merged model"]
    assert [t["type"] for t in fig["data"]] == ["scatter", "scatter", "bar"]  # the experts as reference marks
    assert fig["data"][0]["x"] == ["xx", "en", "average"]
    lines = Path(results if isinstance(results, str) else results["value"]).read_text(encoding="utf-8").splitlines()
    assert len(lines) == 18 and json.loads(lines[0])["model"] == "math expert"
    assert "**xx question 0**" in detail and "gold answer **" in detail and "Sorvi:" in detail
    for m in ("math expert", "language expert", "merged model"):
        assert f"| {m} |" in detail

    second = client.predict("en", 2, api_name="/browse")
    assert "**en question 2** (3 of 3)" in second and "Question:" in second


def test_stop_cancels_and_keeps_finished_batches(client):
    job = client.submit(["xx", "en"], ["math", "lang", "merged"], 0, 0, "native_cot", 16, api_name="/evaluate")
    deadline = time.time() + 120
    while time.time() < deadline:  # wait until it is generating
        st = job.status()
        if st.progress_data and any((p.progress or 0) > 0 for p in st.progress_data):
            break
        time.sleep(0.5)
    said = client.predict(api_name="/stop_eval")
    assert "**Stopped** your job" in said or "**Stopping** your job" in said, said  # it was running
    status, table, *_ = job.result(timeout=300)
    n = int(status.split("answers")[0].split()[-1])
    total = 3 * sum(len(mgsm.load(c, DEMO_MGSM)) for c in ("xx", "en"))
    assert status.startswith("**Cancelled:**") and 0 < n < total


def test_evaluate_bad_input(client):
    with pytest.raises(AppError, match="Choose at least one MGSM language"):
        client.predict([], ["math"], 2, 0, "native_cot", 16, api_name="/evaluate")
    with pytest.raises(AppError, match="Choose at least one model"):
        client.predict(["xx"], [], 2, 0, "native_cot", 16, api_name="/evaluate")


def test_export_card_holds_the_evaluation_of_that_plan(client, tmp_path):
    """An export of the plan that was just evaluated carries its MGSM results; another plan's export does not."""
    client.predict(["xx"], ["math", "lang", "merged"], 2, 0, "native_cot", 16, 2, 1, 1, 1, api_name="/evaluate")
    msg, _ = client.predict(str(tmp_path / "same"), False, 2, 1, 1, 1, api_name="/export")
    assert "The card holds your evaluation" in msg
    prov = json.loads((tmp_path / "same" / "layerswap.json").read_text())
    assert prov["evaluation"]["task"] == "mgsm_native_cot" and prov["evaluation"]["limit"] == 2
    assert "MGSM" in (tmp_path / "same" / "README.md").read_text()
    msg, _ = client.predict(str(tmp_path / "other"), False, 1, 1, 0, 0, api_name="/export")
    assert "holds your evaluation" not in msg
    assert json.loads((tmp_path / "other" / "layerswap.json").read_text())["evaluation"] is None
