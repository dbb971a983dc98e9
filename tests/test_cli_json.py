"""`--json` means the same in every command (issue 39): the result as JSON on stdout and nothing else there,
`--json-out FILE` the same JSON in a file (`lens` is run so in tests/test_lens.py, `search` in tests/test_search.py)."""

from __future__ import annotations

import argparse
import json

from layerswap.cli import build_parser
from tests.helpers import run_cli

DEMO = ["--math", "assets:demo/math", "--lang", "assets:demo/lang"]


def test_every_json_flag_prints_and_json_out_writes():
    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    has = {name: {a.dest: a for a in sp._actions} for name, sp in subs.choices.items()}
    with_json = {cmd for cmd, flags in has.items() if "json" in flags or "json_out" in flags}
    assert with_json >= {"inspect", "search", "lens", "eval"}
    for cmd in with_json:  # one declaration: --json (stdout) or --json FILE, and --json-out FILE
        assert type(has[cmd]["json"]) is type(has["inspect"]["json"]) and has[cmd]["json"].nargs == "?", cmd
        assert has[cmd]["json_out"].metavar == "FILE", cmd
    ns = subs.choices["inspect"].parse_args(["--math", "m", "--lang", "l", "--json"])
    assert ns.json is True and ns.json_out is None
    ns = subs.choices["inspect"].parse_args(["--math", "m", "--lang", "l", "--json", "p.json"])
    assert ns.json is False and ns.json_out == "p.json"  # --json FILE is --json-out FILE


def test_inspect_json_on_stdout_and_in_a_file(tmp_path):
    out = tmp_path / "plans.json"
    r = run_cli("inspect", *DEMO, "--hardware", "cpu-basic,l4x1", "--json", "--json-out", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)  # stdout holds the JSON and nothing else
    assert [x["hardware"] for x in rows] == ["cpu-basic", "l4x1"] and json.loads(out.read_text()) == rows
    assert f"wrote {out}" in r.stderr
    r = run_cli("inspect", *DEMO, "--json")
    assert r.returncode == 2 and "add --hardware" in r.stderr and r.stdout == ""
