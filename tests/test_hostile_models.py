"""Hostile models (issue 30): what a model's own files or the Hub say is data, never a path or markup.

- Shard names (index.json), tokenizer file names and a repo's file list name only files of the model's own
  folder; a refusal echoes no file's content or size (reproduction 1).
- Hub errors never carry the Hub's address (reproduction 7).
- Model-derived text (config strings, answers, questions) is escaped before Markdown/HTML, and code blocks
  cannot be closed by what they show (reproduction 6): see `layerswap.markup`.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from layerswap.checkpoints import Checkpoint
from layerswap.errors import UserError
from layerswap.hosting import Limits
from tests.helpers import JsonHandler, serve

SHA = "c" * 40
MARKER = 1234.5  # the gated model's secret value


def _hub_snapshot(cache: Path, repo: str, src: Path) -> Path:
    """`src`'s files laid out as the Hugging Face cache holds a downloaded repo (blobs, snapshots/<sha>)."""
    snap = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / SHA
    snap.mkdir(parents=True)
    blobs = snap.parent.parent / "blobs"
    blobs.mkdir()
    for f in src.iterdir():
        blob = blobs / f"{f.name}.blob"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(Path("../../blobs") / blob.name)
    return snap


@pytest.fixture
def evil_cache(trio, tmp_path):
    """A cache holding a gated model (a marker value in its weights) and a public repo whose index names shards
    that are not its own; returns the cache, the public snapshot and the gated model's weight file."""
    cache = tmp_path / "hub"
    secret = tmp_path / "secret-src"
    shutil.copytree(trio["math"], secret)
    tensors = load_file(str(secret / "model.safetensors"))
    name = next(iter(tensors))
    tensors[name] = torch.full_like(tensors[name], MARKER)
    save_file(tensors, str(secret / "model.safetensors"), metadata={"format": "pt"})
    gated = _hub_snapshot(cache, "gated/secret", secret)
    evil_src = tmp_path / "evil-src"
    evil_src.mkdir()
    for f in trio["math"].iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, evil_src / f.name)
    snap = _hub_snapshot(cache, "evil/math", evil_src)
    return cache, snap, gated / "model.safetensors", name


def _write_index(snap: Path, shard: object) -> None:
    index = snap / "model.safetensors.index.json"
    index.unlink(missing_ok=True)
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"model.embed_tokens.weight": shard}}))


@pytest.mark.parametrize("kind", ["relative", "absolute", "etc-passwd", "dot", "backslash", "not-a-string"])
def test_an_index_cannot_name_files_outside_the_models_own_folder(evil_cache, kind):
    """Reproduction 1: a public repo's index pointing at a gated model's shard in the same cache (`../`), at its
    absolute path, or at /etc/passwd: refused before any byte of it is read; the refusal says neither the
    file's first bytes nor its size."""
    cache, snap, secret_file, _ = evil_cache
    shard = {"relative": f"../../../models--gated--secret/snapshots/{SHA}/model.safetensors",
             "absolute": str(secret_file), "etc-passwd": "/etc/passwd", "dot": "./model.safetensors",
             "backslash": "..\\..\\model.safetensors", "not-a-string": {"path": "/etc/passwd"}}[kind]
    _write_index(snap, shard)
    with pytest.raises(UserError, match="not a file of the model's own folder") as e:
        Checkpoint.from_folder(snap, "evil/math")
    msg = str(e.value)
    sizes = {str(secret_file.stat().st_size), str(Path("/etc/passwd").stat().st_size)}
    assert not any(f" {s}" in msg for s in sizes) and "header" not in msg and "bytes" not in msg, msg


def test_an_index_naming_its_own_shards_opens(trio, tmp_path):
    """The rule keeps ordinary sharded models and Hub snapshots (links into the cache's blobs) working."""
    snap = _hub_snapshot(tmp_path / "hub", "good/math", trio["math"])
    _write_index(snap, "model.safetensors")
    ck = Checkpoint.from_folder(snap, "good/math")
    assert ck.weight_files == [snap / "model.safetensors"] and ck.tokenizer_files()


def test_tokenizer_config_cannot_name_files_elsewhere(trio, tmp_path):
    """The same rule for file names a tokenizer's config gives (transformers would open them)."""
    folder = tmp_path / "m"
    shutil.copytree(trio["math"], folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "vocab_file": "/etc/passwd"}))
    ck = Checkpoint.open(folder)
    with pytest.raises(UserError, match="vocab_file names '/etc/passwd', which is not a file"):
        ck.tokenizer_files()


class EvilListing(JsonHandler):
    """A Hub whose file list names a file outside the repo, and whose errors carry its own address."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if "/api/models/evil/list" in self.path:
            self.reply({"id": "evil/list", "sha": SHA, "private": False, "gated": False,
                        "siblings": [{"rfilename": "config.json", "size": 10},
                                     {"rfilename": "../../gated/model.safetensors", "size": 10}]})
        else:
            self.reply({"error": "Repository Not Found"}, status=404)


@pytest.fixture
def evil_hub(monkeypatch, tmp_path):
    import huggingface_hub.constants as c

    from layerswap.hub import hub_reachable

    for url in serve(EvilListing):
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setattr(c, "ENDPOINT", url)
        monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
        hub_reachable.cache_clear()
        yield url
        hub_reachable.cache_clear()


def test_a_repo_file_list_naming_files_elsewhere_is_refused(evil_hub):
    from layerswap.hosting import plan_download

    with pytest.raises(UserError, match="outside the repo's own folder"):
        plan_download("evil/list", Limits())


def test_hub_errors_do_not_name_the_hub_endpoint(evil_hub):
    """Reproduction 7 (messages): a missing repo's error says what failed, not where the Hub is."""
    from layerswap.hosting import plan_download

    host = re.sub(r"^https?://", "", evil_hub)
    with pytest.raises(UserError) as e:
        plan_download("nobody/missing", Limits())
    assert "404" in str(e.value) and host not in str(e.value) and "http" not in str(e.value), str(e.value)


# ---- model-derived text is text (reproduction 6) ---------------------------------------------------------------

EVIL = ("Session expired: [sign in again](https://evil.example/login) ![](https://evil.example/pixel.png) "
        "<img src=https://evil.example/p2.png> www.evil.example `` ``` $$\\href{https://evil.example}{x}$$")


def _html(md: str) -> str:
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable("table").render(md)


def _assert_inert(md: str) -> None:
    """No link, image or tag in the rendered page, and no bare address a GFM renderer would link."""
    out = _html(md)
    assert "<a " not in out and "<img" not in out and "<h1>" not in out, out
    assert not re.search(r"(?<!\\)(://|www\.)", md), md


def test_config_strings_are_shown_as_text(trio, tmp_path):
    """A repo whose config.json `architectures` holds a link and an image: the models' report (what a victim's
    page shows for `/?math=evil/math&lang=evil/lang`) renders neither, and says the string as typed."""
    from layerswap.checkpoints import check_compatible

    cks = []
    for role in ("math", "lang"):
        d = tmp_path / role
        shutil.copytree(trio[role], d)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "architectures": [EVIL]}))
        cks.append(Checkpoint.open(d))
    md = check_compatible(*cks).markdown()
    _assert_inert(md)
    assert "Session expired" in _html(md) and "sign in again" in _html(md)


@pytest.mark.parametrize("layers", [10**9, 4097, 0, -1, 3.5, "8", True, [8], None])
def test_a_config_layer_count_is_bounded_before_anything_is_expanded(trio, tmp_path, layers):
    """Every per-layer list (plans, the strip, heatmaps, sliders) is as long as the config's num_hidden_layers: a
    repo saying 10**9 (its tensors hold 4 layers) is refused when opened, as is any count that is not a whole number
    from 1 to 4096 and a config that is not an object; the refusal echoes nothing of the file."""
    from layerswap.bounds import MAX_LAYERS

    d = tmp_path / "m"
    shutil.copytree(trio["math"], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": layers}))
    with pytest.raises(UserError, match="num_hidden_layers") as e:
        Checkpoint.open(d)
    assert f"1 to {MAX_LAYERS:,}" in str(e.value) or layers is None
    assert "1000000000" not in str(e.value) and "4097" not in str(e.value)
    (d / "config.json").write_text(json.dumps([cfg]))
    with pytest.raises(UserError, match="is not a JSON object of settings"):
        Checkpoint.open(d)


@pytest.mark.parametrize("value", ["abc", 1e30, -5, 0, [1], 2**40])
def test_a_config_size_is_bounded_before_the_planner_computes_with_it(trio, tmp_path, value):
    """The sizes layerswap reads from a config (heads, head size, vocabulary, positions...) are whole numbers in
    range, or the model is refused when opened with the key named (a string there crashed the engine planner)."""
    from layerswap.bounds import CONFIG_SIZES

    d = tmp_path / "m"
    shutil.copytree(trio["math"], d)
    cfg = json.loads((d / "config.json").read_text())
    for key in CONFIG_SIZES:
        (d / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(UserError, match=f"config.json's {key} is not a whole number"):
            Checkpoint.open(d)
    (d / "config.json").write_text(json.dumps({**cfg, "head_dim": None}))  # absent or null: derived, as before
    assert Checkpoint.open(d).num_layers == cfg["num_hidden_layers"]


def test_a_config_that_does_not_match_its_tensors_is_refused_without_allocating(trio, tmp_path):
    """A trio whose configs ask for an MLP 50,000 times wider than their tensors (59 GB at 8 layers; transformers
    allocates and initialises it before it finds the mismatch): the engine plan says answers are off and why, and
    loading a model is refused, before the memory is taken. A config asking for less is refused with what to do."""
    import resource

    from layerswap.engines.transformers_engine import load_model, size_problem
    from layerswap.workbench import Workbench

    def trio_with(mlp) -> dict[str, str]:
        refs = {}
        for role in ("base", "math", "lang"):
            d = tmp_path / f"{mlp.__name__}-{role}"
            shutil.copytree(trio[role], d)
            cfg = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": mlp(cfg["intermediate_size"])}))
            refs[role] = str(d)
        return refs

    def wider(n):
        return n * 50_000

    def narrower(n):
        return n // 2

    refs = trio_with(wider)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(UserError, match="billion numbers, its weights hold .* the config does not match the weights"):
        load_model(refs["math"])
    wb = Workbench(engine="transformers")
    wb.check(refs["math"], refs["lang"], refs["base"], force=True)  # the report and heatmaps work from headers
    plan = wb.engine_plan
    assert plan.arrangement == "none" and plan.problem.startswith("the math expert: its config.json describes")
    with pytest.raises(UserError, match="Answers are off: the math expert: its config.json describes"):
        wb.start()
    assert not wb.engines
    wb.close()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 2 * 2**20  # KiB: under 2 GiB more
    with pytest.raises(UserError, match="config.json does not match its tensors' shapes"):
        load_model(trio_with(narrower)["math"])
    # only the table's dense families are built on the meta device: a mixture of a million experts is not
    moe = {**json.loads((Path(refs["math"]) / "config.json").read_text()), "model_type": "mixtral",
           "num_local_experts": 10**6}
    assert size_problem(moe, 1) == ""


def test_answers_and_questions_cannot_close_their_code_blocks():
    """Three (or more) backticks in an answer or a question stay inside their block."""
    from layerswap import mgsm
    from layerswap.markup import block, code
    from layerswap.ui.tabs.ask import _answer_md
    from layerswap.workbench import Answer

    out = "12\n```\n# Session expired\n[sign in](https://evil.example/x)\n````\n<img src=x>"
    a = Answer("merged", "q", mgsm.score(out, 12, mgsm.get_language("en")), 12, "transformers", 0.1)
    rendered = _html(_answer_md(a))
    assert rendered.count("<pre>") == 1 and "<h1>" not in rendered and "<a " not in rendered
    assert "# Session expired" in rendered and "&lt;img" in rendered
    assert _html(block("x ````` y")).count("<pre>") == 1
    assert "<code>a ``` b</code>" in _html(code("a ``` b"))


def test_error_dialogs_show_html_as_text():
    """Gradio's error dialog renders HTML: a message quoting a model's file is escaped first."""
    import gradio as gr

    from layerswap.ui.events import guarded

    def fail():
        raise UserError(f"evil/math: its index names {EVIL!r}")

    with pytest.raises(gr.Error) as e:
        guarded(fail)()
    assert "<img" not in e.value.message and "&lt;img" in e.value.message


def test_the_hub_cache_is_pruned_least_recently_used_first_never_a_model_in_use(trio, tmp_path):
    """Reproduction 5 (the Hub cache): pruned to its setting, oldest access first, models in use kept."""
    import os
    import time

    from layerswap.hosting import prune_hub_cache

    cache = tmp_path / "hub"
    snaps = {repo: _hub_snapshot(cache, repo, trio["math"]) for repo in ("old/a", "inuse/b", "new/c")}
    now = time.time()
    for i, repo in enumerate(("inuse/b", "old/a", "new/c")):  # inuse/b is the least recently used
        for blob in (snaps[repo].parent.parent / "blobs").iterdir():
            os.utime(blob, (now - 1000 + 100 * i, now - 1000 + 100 * i))
    one = sum(f.stat().st_size for f in (snaps["old/a"].parent.parent / "blobs").iterdir())
    gone = prune_hub_cache(2 * one, keep={"inuse/b"}, cache=cache)
    assert gone == ["old/a"] and snaps["inuse/b"].exists() and snaps["new/c"].exists()
    assert not (cache / "models--old--a").exists()


# ---- weights whose header lies about where the bytes are (issue 39) --------------------------------------------

def _shared_bytes(src: Path, dst: Path) -> tuple[str, str]:
    """`src`'s model with layer 1's q_proj pointing at layer 0's q_proj bytes, its own bytes cut out and every later
    tensor moved down: each range in bounds and the size its shape needs, the data covered exactly, one overlap."""
    from layerswap.tensorfile import read_header

    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    blob, entries = f.read_bytes(), read_header(f)
    (n,) = struct.unpack("<Q", blob[:8])
    header, data = json.loads(blob[8:8 + n]), blob[8 + n:]
    first, second = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"
    b, e = header[second]["data_offsets"]
    for name, entry in header.items():
        if name != "__metadata__" and entry["data_offsets"][0] >= e:
            entry["data_offsets"] = [o - (e - b) for o in entry["data_offsets"]]
    header[second]["data_offsets"] = header[first]["data_offsets"]
    raw = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data[:b] + data[e:])
    assert entries[first].nbytes == entries[second].nbytes
    return first, second


def test_weights_read_twice_are_refused_as_safetensors_refuses_them(trio, tmp_path, capsys):
    """A shard whose two tensors share bytes opened and merged before (the old reader checked each range alone);
    safetensors' own reader refuses it ("invalid offset"), and so do opening it and `layerswap merge`, in one line."""
    from safetensors import SafetensorError, safe_open

    from layerswap.cli import main as cli

    bad = tmp_path / "math"
    _, second = _shared_bytes(trio["math"], bad)
    with pytest.raises(SafetensorError, match="invalid offset"):
        safe_open(str(bad / "model.safetensors"), "pt")
    with pytest.raises(UserError, match=re.escape(f"tensor {second!r} claims bytes")):
        Checkpoint.open(bad)
    out = tmp_path / "merged"
    rc = cli(["merge", "--math", str(bad), "--lang", str(trio["lang"]), "--base", str(trio["base"]),
              "--b", "1", "--u", "1", "--tb", "1", "--tu", "1", "-o", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and not out.exists()
    assert err.count("\n") == 0 and "may neither overlap nor leave gaps" in err and err.endswith("re-export it.")
