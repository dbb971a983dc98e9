"""Hostile models (issue 30): what a model's own files or the Hub say is data, never a path or markup.

- Shard names (index.json), tokenizer file names and a repo's file list name only files of the model's own
  folder; a refusal echoes no file's content or size (reproduction 1).
- Hub errors never carry the Hub's address (reproduction 7).
- Model-derived text (config strings, answers, questions) is escaped before Markdown/HTML, and code blocks
  cannot be closed by what they show (reproduction 6): see `layerswap.core.markup`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from layerswap.models.checkpoints import Checkpoint
from layerswap.core.errors import UserError
from layerswap.serving.hosting import Limits
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

    from layerswap.models.hub import hub_reachable

    for url in serve(EvilListing):
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setattr(c, "ENDPOINT", url)
        monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
        hub_reachable.cache_clear()
        yield url
        hub_reachable.cache_clear()


def test_a_repo_file_list_naming_files_elsewhere_is_refused(evil_hub):
    from layerswap.serving.hosting import plan_download

    with pytest.raises(UserError, match="outside the repo's own folder"):
        plan_download("evil/list", Limits())


def test_hub_errors_do_not_name_the_hub_endpoint(evil_hub):
    """Reproduction 7 (messages): a missing repo's error says what failed, not where the Hub is."""
    from layerswap.serving.hosting import plan_download

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
    from layerswap.models.checkpoints import check_compatible

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
    from layerswap.core.bounds import MAX_LAYERS

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
    from layerswap.core.bounds import CONFIG_SIZES

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
    from layerswap.serving.workbench import Workbench

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
    from layerswap.evaluation import mgsm
    from layerswap.core.markup import block, code
    from layerswap.ui.tabs.ask import _answer_md
    from layerswap.serving.workbench import Answer

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

    from layerswap.serving.hosting import prune_hub_cache

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


# ---- hostile files, round 3 (issue 41): nothing a model brings runs unbounded ----------------------------------

SECONDS = 5.0  # each refusal's CPU seconds (not wall time: a loaded machine must not fail it), after start-up ...
GROWTH_MB = 500  # ... and its peak memory over the process's size after them
DEEP = "[" * 100_000 + "]" * 100_000
REDOS = ("(.*.*)*X", "^(([a-z._0-9])+)+$!")
STEPS = "it runs (more than 100,000 steps|longer than 2 s)"  # a template's refusal: whichever comes first
NESTED_RANGE = "{% for i in range(99999) %}{% for j in range(99999) %}{{'x'}}{% endfor %}{% endfor %}"
# each case of the batch runs in one process that has imported everything first; it reports, per case, the exit
# status, stderr, seconds and its peak resident memory over its start (the peak is reset before each case; the
# address space is capped 2 GB above the imports, so a regression fails here instead of taking the machine)
_BATCH = r"""
import contextlib, io, json, resource, sys, time
import torch, transformers, peft, jinja2, layerswap.cli, layerswap.models.adapters, layerswap.engines.transformers_engine
vm = int(next(ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("VmSize"))) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 2 * 2**30, vm + 2 * 2**30))
def status_mb(field):
    return int(next(ln.split()[1] for ln in open("/proc/self/status") if ln.startswith(field + ":"))) / 1024
for case in json.load(open(sys.argv[1])):
    with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) starts again from the current size
        f.write("5")
    rss0 = status_mb("VmRSS")
    err, t0 = io.StringIO(), time.process_time()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = layerswap.cli.main(case["args"])
        except BaseException as e:
            import traceback
            traceback.print_exc(file=err)
            rc = f"raised {type(e).__name__}"
    grown = status_mb("VmHWM") - rss0
    print(json.dumps({"id": case["id"], "rc": rc, "stderr": err.getvalue(), "seconds": time.process_time() - t0,
                      "grown_mb": grown}), flush=True)
"""


def _adapter(root: Path, src: str, name: str, **changes) -> Path:
    """A copy of a shipped adapter with its config changed (a value given as str `RAW:...` is written verbatim)."""
    d = root / name
    if not root.exists():  # naming the cases only (collection)
        return d
    shutil.copytree(REPO_ASSETS / "ablation" / src, d)
    cfg = json.loads((d / "adapter_config.json").read_text())
    raw = {k: v[4:] for k, v in changes.items() if isinstance(v, str) and v.startswith("RAW:")}
    cfg.update({k: (f"@@{k}@@" if k in raw else v) for k, v in changes.items()})
    text = json.dumps(cfg)
    for k, v in raw.items():
        text = text.replace(f'"@@{k}@@"', v)
    (d / "adapter_config.json").write_text(text)
    return d


def _model(root: Path, name: str, edit) -> Path:
    d = root / name
    if root.exists():  # else naming the cases only (collection)
        shutil.copytree(REPO_ASSETS / "math", d)
        edit(d)
    return d


def _patch_json(file: str, text_edit):
    return lambda d: (d / file).write_text(text_edit((d / file).read_text()))


def _deep_header(d: Path) -> None:
    """model.safetensors whose header holds 100k nested brackets before its real entries."""
    f = d / "model.safetensors"
    raw = f.read_bytes()
    (n,) = __import__("struct").unpack("<Q", raw[:8])
    header = b'{"x":' + DEEP.encode() + b"," + raw[9:8 + n]
    f.write_bytes(__import__("struct").pack("<Q", len(header)) + header + raw[8 + n:])


def _big_tokenizer(d: Path, extra: int) -> None:
    """tokenizer.json with `extra` more vocabulary entries (3M: a 66 MB file for a model of 373 tokens)."""
    f = d / "tokenizer.json"
    text = f.read_bytes()
    at = text.index(b'"vocab":') + len(b'"vocab":')
    at = text.index(b"{", at) + 1
    more = b"".join(b'"zz%d":%d,' % (i, 1000 + i) for i in range(extra))
    f.write_bytes(text[:at] + more + text[at:])


REPO_ASSETS = Path(__file__).resolve().parent.parent / "assets" / "demo"


def _cases(root: Path) -> list[dict]:
    """(id, CLI arguments, what the one-line refusal must say); every folder built under `root`."""
    base, lang_lora, lang_ia3 = (str(REPO_ASSETS / p) for p in ("base", "ablation/lang_lora", "ablation/lang_ia3"))
    out = []

    def inspect(cid, math, lang, match):
        out.append({"id": cid, "args": ["inspect", "--math", str(math), "--lang", lang, "--base", base],
                    "match": match})

    def merge(cid, math, lang, match):
        out.append({"id": cid, "args": ["merge", "--math", str(math), "--lang", lang, "--base", base, "--force",
                                        "--b", "1", "--u", "1", "--tb", "1", "--tu", "1", "-o", str(root / cid)],
                    "match": match})

    not_plain = "is not a plain list of module names"
    for i, pat in enumerate(REDOS):
        inspect(f"lora-target-{i}", _adapter(root, "math_lora", f"lt{i}", target_modules=pat), lang_lora, not_plain)
        merge(f"merge-lora-target-{i}", _adapter(root, "math_lora", f"mlt{i}", target_modules=pat), lang_lora,
              not_plain)
        inspect(f"lora-rank-pattern-{i}", _adapter(root, "math_lora", f"rp{i}", rank_pattern={pat: 4}), lang_lora,
                not_plain)
        inspect(f"lora-alpha-pattern-{i}", _adapter(root, "math_lora", f"ap{i}", alpha_pattern={pat: 4}), lang_lora,
                not_plain)
        inspect(f"lora-exclude-{i}", _adapter(root, "math_lora", f"ex{i}", exclude_modules=pat), lang_lora, not_plain)
        inspect(f"lora-layers-pattern-{i}", _adapter(root, "math_lora", f"lp{i}", layers_pattern=pat,
                                                     layers_to_transform=[2]), lang_lora, "must be a module name")
        inspect(f"lora-modules-to-save-{i}", _adapter(root, "math_lora", f"ms{i}", modules_to_save=[pat]), lang_lora,
                "must be a module name")
        inspect(f"ia3-target-{i}", _adapter(root, "math_ia3", f"it{i}", target_modules=pat), lang_ia3, not_plain)
        inspect(f"ia3-feedforward-{i}", _adapter(root, "math_ia3", f"if{i}", feedforward_modules=pat), lang_ia3,
                not_plain)
        merge(f"merge-ia3-feedforward-{i}", _adapter(root, "math_ia3", f"mif{i}", feedforward_modules=pat), lang_ia3,
              not_plain)
    nan = "is not valid JSON \\((NaN|Infinity|-Infinity) is not a JSON number\\)"
    for v in ("NaN", "Infinity", "-Infinity"):
        merge(f"lora-alpha-{v}", _adapter(root, "math_lora", f"al{v}", lora_alpha=f"RAW:{v}"), lang_lora, nan)
    merge("alpha-pattern-NaN", _adapter(root, "math_lora", "apn", alpha_pattern="RAW:{\"q_proj\": NaN}"), lang_lora,
          nan)
    merge("lora-alpha-1e308", _adapter(root, "math_lora", "alb", lora_alpha=1e308), lang_lora,
          "lora_alpha must be a number in \\(0, 65536\\]")
    inspect("alpha-pattern-0", _adapter(root, "math_lora", "apz", alpha_pattern={"q_proj": 0}), lang_lora,
            "must be a number in")
    inspect("r-true", _adapter(root, "math_lora", "rt", r=True), lang_lora, "r must be a whole number")
    inspect("rank-pattern-true", _adapter(root, "math_lora", "rpt", rank_pattern={"q_proj": True}), lang_lora,
            "must be a whole number")
    inspect("modules-to-save-absent", _adapter(root, "math_lora", "msa", modules_to_save=["model.nowhere"]),
            lang_lora, "modules_to_save names 'model.nowhere', which .* does not have")
    inspect("adapter-config-deep", _adapter(root, "math_lora", "acd", extra=f"RAW:{DEEP}"), lang_lora,
            "more than 64 levels of nested brackets")
    lang = str(REPO_ASSETS / "lang")
    deep = "more than 64 levels of nested brackets"
    inspect("config-deep", _model(root, "cd", _patch_json("config.json", lambda t: t.replace("{", '{"x":' + DEEP + ",", 1))),
            lang, deep)
    inspect("config-eps-NaN", _model(root, "cen", _patch_json(
        "config.json", lambda t: re.sub(r'"rms_norm_eps": [^,]+', '"rms_norm_eps": NaN', t))), lang, nan)
    inspect("config-eps-negative", _model(root, "cem", _patch_json(
        "config.json", lambda t: re.sub(r'"rms_norm_eps": [^,]+', '"rms_norm_eps": -1e-5', t))), lang,
        "norm epsilon is not a number in \\(0, 1\\]")
    inspect("generation-config-NaN", _model(root, "gcn", _patch_json(
        "generation_config.json", lambda t: t.replace("{", '{"temperature": NaN,', 1))), lang, nan)
    inspect("safetensors-header-deep", _model(root, "shd", _deep_header), lang,
            "header is not JSON: more than 64 levels")
    ask = ["ask", "--lang", lang, "--base", base, "--question", "2+2?", "--engine", "transformers",
           "--max-new-tokens", "2", "--math"]
    template = lambda t: _patch_json("tokenizer_config.json",  # noqa: E731
                                     lambda s: json.dumps({**json.loads(s), "chat_template": t}))
    nested = str(_model(root, "tn", template(NESTED_RANGE)))
    out.append({"id": "template-nested-range", "args": [*ask, nested, "--chat-template"],
                "match": "tokenizer_config.json: its chat template is refused \\(" + STEPS + "\\)"})
    out.append({"id": "template-not-asked", "args": [*ask, nested], "match": None})  # never rendered: answers
    big = str(_model(root, "tb", template("{% for i in range(10**9) %}x{% endfor %}")))
    out.append({"id": "template-range-1e9", "args": [*ask, big, "--chat-template"],
                "match": "tokenizer_config.json: its chat template is refused \\(safe_range with 1,000,000,000\\)"})
    out.append({"id": "tokenizer-66MB", "args": [*ask, str(_model(root, "tk", lambda d: _big_tokenizer(d, 3_000_000)))],
                "match": "its tokenizer.json is [0-9,]+ bytes, more than the 1,048,576 a tokenizer of 373 tokens"})
    out.append({"id": "tokenizer-more-tokens", "args": [*ask, str(_model(root, "tm", lambda d: _big_tokenizer(d, 2000)))],
                "match": "its tokenizer has 2,373 tokens, more than the model's 373"})
    out.append({"id": "tokenizer-config-deep", "args": [*ask, str(_model(root, "tcd", _patch_json(
        "tokenizer_config.json", lambda t: t.replace("{", '{"x":' + DEEP + ",", 1))))], "match": deep})
    return out


@pytest.fixture(scope="module")
def hostile_runs(tmp_path_factory) -> dict[str, dict]:
    """Every hostile case through the CLI, in one process (start-up paid once); results by case id."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("hostile41")
    cases = _cases(root)
    (root / "cases.json").write_text(json.dumps(cases))
    env = {**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           "LAYERSWAP_CACHE": str(root / "cache")}
    proc = subprocess.run([sys.executable, "-c", _BATCH, str(root / "cases.json")], capture_output=True, text=True,
                          timeout=60 + 10 * len(cases), env=env)
    runs = {r["id"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert len(runs) == len(cases), f"stopped after {list(runs)[-1:]}: {proc.stderr[-3000:]}"
    return {c["id"]: {**runs[c["id"]], "match": c["match"]} for c in cases}


CASE_IDS = [c["id"] for c in _cases(Path("/nonexistent-layerswap-cases"))]


@pytest.mark.parametrize("case", CASE_IDS)
def test_a_hostile_file_is_refused_quickly_in_one_line(hostile_runs, case):
    """Issue 41, items 1-5, through the CLI: each hostile file is refused within `SECONDS` and `GROWTH_MB` with
    one line saying what is wrong (no traceback); a chat template nobody asked for is never rendered."""
    r = hostile_runs[case]
    print(f"\n{case}: {r['seconds']:.2f} s, +{r['grown_mb']:.0f} MB")
    assert r["grown_mb"] < GROWTH_MB, r
    if r["match"] is None:
        assert r["rc"] == 0 and r["seconds"] < 60, r
        return
    errors = [ln for ln in r["stderr"].splitlines() if ": error: " in ln]
    assert r["rc"] == 2 and "Traceback" not in r["stderr"] and len(errors) == 1, r
    assert re.search(r["match"], errors[0]), errors[0]
    assert r["seconds"] < SECONDS, r


REAL_TEMPLATES = {  # shapes of widely used chat templates (ChatML as Qwen 2.5, Llama 3, Mistral with checks)
    "chatml": "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
              "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
              "{%- endif %}{%- for message in messages %}{%- if message.role == 'user' %}{{- '<|im_start|>' + "
              "message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
              "{% generation %}{{ 'x' }}{% endgeneration %}"
              "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "llama3": "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
              "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
              "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
              "{{ content }}{% endfor %}{% if add_generation_prompt %}"
              "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
    "mistral": "{%- set ns = namespace(n=0) %}{%- for m in messages %}{%- if m['role'] not in ['user', 'assistant'] %}"
               "{{ raise_exception('Only user and assistant roles are supported!') }}{%- endif %}"
               "{%- set ns.n = ns.n + 1 %}{%- endfor %}{{ bos_token }}{%- for m in messages %}[INST] "
               "{{ m['content'] }} [/INST]{%- endfor %}{{ ns.n|string }}{{ {'n': ns.n}|tojson }}"
               "{{ '%-5s|' % 'ab' }}{{ 'x'|center(9) }}{{ '{:>4}'.format(7) }}{{ ', '.join(['a', 'b']) }}"
               "{{ tools is none }}{{ documents is none }}{{ 'n=' ~ ns.n ~ '|' ~ [1, 'a'] }}{{ 'a\tb'|indent(2, true) }}{{ messages|tojson(indent=2) }}",
}


@pytest.mark.parametrize("name", sorted(REAL_TEMPLATES))
def test_a_bounded_render_is_transformers_render(name):
    """The bounded renderer (`engines.chat.render_chat`) gives what transformers' apply_chat_template gives for
    real templates, string for string (the prompt holds text that looks like format widths and stars)."""
    from layerswap.shipped.demo import build_tokenizer
    from layerswap.engines.chat import render_chat

    tok = build_tokenizer(chat_template=REAL_TEMPLATES[name])
    prompt = "Janet: 16 eggs * 3 = 48; {:99999999} %99999999d and 1234567890."
    want = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    assert render_chat(tok, prompt) == want


@pytest.mark.parametrize("template,why", [
    (NESTED_RANGE, STEPS),
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", STEPS),
    ("{% for i in range(10**9) %}x{% endfor %}", "safe_range with 1,000,000,000"),
    ("{{ 'x' * 10**9 }}", "a repetition would build 1,000,000,000"),
    ("{{ 'x'|center(1000000000) }}", "the center filter with 1,000,000,000"),
    ("{{ 'x'.ljust(1000000000) }}", "ljust with 1,000,000,000"),
    ("{{ '%1000000000d'|format(1) }}", "a width of a million or more"),
    ("{{ '%1000000000d' % 1 }}", "a width of a million or more"),
    ("{{ '{:>1000000000}'.format(1) }}", "a width of a million or more"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "a ~ concatenation would build 1,048,576"),
    ("{% set a = 'xx' %}" + "{% set a = a ~ a %}" * 40, "a ~ concatenation would build 1,048,576"),
    ("{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(40) }}", STEPS),
    ("{% set s = 'x' * 900000 %}{{ s|replace('x', s) }}", "the replace filter would build"),
    ("{% set s = 'x' * 900000 %}{{ s|join(s) }}", "the join filter would build"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{% set s = 'x' * 900000 %}{{ ([s] * 1000)|tojson }}", "a repetition would build 900,001,000"),
    ("{% set s = 'x' * 900000 %}{{ s ~ s ~ s }}", "a ~ concatenation would build 2,700,000"),
    ("{% set s = 'x' * 900000 %}{{ '{}{}{}'.format(s, s, s) }}", "format would build 2,700,000"),
    ("{% set n = 10 ** 64 %}{% set m = n ** 64 %}{{ m ** 64 }}", "a power would build a number of"),
    ("{% set s = '\n' * 900000 %}{{ s|indent(999999) }}", "the indent filter would build"),
    ("{% set s = '\t' * 900000 %}{{ s.expandtabs(999999) }}", "expandtabs would build"),
    ("{{ messages|tojson(indent=999999) }}", "tojson with an indent of 999999"),
    ("{{ lipsum(999999) }}", "'lipsum' is undefined"),
    ("{{ messages.__class__.__mro__ }}", "cannot be rendered"),
    ("{% for %}", "TemplateSyntaxError"),
])
def test_a_hostile_chat_template_is_refused_quickly_naming_its_file(tmp_path, template, why):
    """Issue 41 item 2 and its neighbours: loops, repetition, widths, doubling, recursion; each refused in well
    under a second and a few MB, with the template's file named."""
    import resource
    import time

    from layerswap.shipped.demo import build_tokenizer, make_tiny_llama
    from layerswap.engines.base import TokenizingEngine, load_tokenizer

    folder = make_tiny_llama(tmp_path / "m", layers=1, tokenizer=build_tokenizer(chat_template=template))
    tok = load_tokenizer(folder)
    assert not TokenizingEngine(tok).use_chat_template  # not asked: never rendered
    rss, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.process_time()
    with pytest.raises(UserError, match=re.escape(why) if "(" not in why else why) as e:
        TokenizingEngine(tok, use_chat_template=True)  # asked: rendered once, before any weight would load
    assert time.process_time() - t0 < 3 and resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 100 * 1024
    source = folder / "chat_template.jinja"  # where transformers saves a template (else tokenizer_config.json)
    source = source if source.is_file() else folder / "tokenizer_config.json"
    assert str(e.value).startswith(f"{source}: its chat template") and "\n" not in str(e.value)


# ---- the same files as Hub repos, through the hosted page (one app for every case) ------------------------------

class HostileHub(JsonHandler):
    """The Hub's model-info endpoint for the hostile repos (their files are in the app's Hub cache at `SHA`, as a
    download left them; hf_hub_download at a commit reads them from there)."""

    repos: dict[str, list] = {}

    def do_GET(self):  # noqa: N802 (http.server's name)
        m = re.match(r"/api/models/([^/]+/[^/?]+)", self.path)
        files = self.repos.get(m.group(1)) if m else None
        if files is None:
            self.reply({"error": "Repository Not Found"}, status=404)
            return
        if "/tree/" in self.path:  # snapshot_download's file list
            body = json.dumps([{"type": "file", "oid": "d" * 40, "size": s, "path": n} for n, s in files]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.reply({"id": m.group(1), "modelId": m.group(1), "sha": SHA, "private": False, "gated": False,
                    "siblings": [{"rfilename": n, "size": s} for n, s in files]})


@pytest.fixture(scope="module")
def hostile_page(tmp_path_factory):
    """The hosted app (a subprocess, `launch_app`) on a fake Hub holding the hostile repos; warmed up on a clean
    trio of Hub repos (loaded and asked), so what the cases add to its memory is theirs. Yields (url, pid, baseline
    peak MB)."""
    from gradio_client import Client

    from tests.helpers import launch_app

    work = tmp_path_factory.mktemp("hostile-page")
    build = work / "build"
    build.mkdir()
    lora_nan = _adapter(build, "math_lora", "nan-lora", lora_alpha="RAW:NaN")
    srcs = {"evil/base": REPO_ASSETS / "base", "evil/math": REPO_ASSETS / "math", "evil/lang": REPO_ASSETS / "lang",
            "evil/lang-lora": REPO_ASSETS / "ablation" / "lang_lora",
            "evil/redos-lora": _adapter(build, "math_lora", "redos-lora", target_modules=REDOS[0]),
            "evil/nan-lora": lora_nan,
            "evil/template": _model(build, "template", _patch_json("tokenizer_config.json", lambda s: json.dumps(
                {**json.loads(s), "chat_template": NESTED_RANGE}))),
            "evil/big-tokenizer": _model(build, "big-tokenizer", lambda d: _big_tokenizer(d, 3_000_000)),
            "evil/deep-config": _model(build, "deep-config", _patch_json(
                "config.json", lambda t: t.replace("{", '{"x":' + DEEP + ",", 1)))}
    cache = work / "hf" / "hub"
    for repo, src in srcs.items():
        _hub_snapshot(cache, repo, src)
        HostileHub.repos[repo] = [(f.name, f.stat().st_size) for f in sorted(src.iterdir())]
    for hub in serve(HostileHub):
        env = {"LAYERSWAP_HOSTED": "1", "HF_ENDPOINT": hub, "HF_HOME": str(work / "hf"), "HF_HUB_CACHE": str(cache)}
        for url in launch_app(work, mgsm_dir=None, env_extra=env):
            from tests.helpers import APPS

            pid = APPS[url].pid
            warm = Client(url, verbose=False)
            warm.predict("evil/base", "evil/math", "evil/lang", False, api_name="/load")
            _page_ask(warm)
            yield url, pid, _status_mb(pid, "VmHWM")


def _cpu_seconds(pid: int) -> float:
    """The server's CPU seconds so far (user + system, all threads): a bound on work done, whatever the load."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status_mb(pid: int, field: str) -> float:
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def _page_ask(client) -> list:
    params = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/ask"]["parameters"]
    given = {"free_text": "2+2?", "max_new_tokens": 16, "lang": "en", "index": None}
    args = [given.get(p["parameter_name"], p.get("parameter_default")) for p in params]
    import time

    import httpx

    for _ in range(120):  # the Load's follow-up events (views, analysis) still hold this visitor's turn: wait
        try:
            return client.submit(*args, api_name="/ask").result(timeout=60)
        except httpx.HTTPStatusError as e:
            if e.response.status_code != 400 or "busy" not in e.response.text.lower():
                raise AssertionError(e.response.text[:500]) from None
            time.sleep(0.5)
    raise AssertionError("Ask was never admitted")


PAGE_CASES = {  # math expert (Hub repo), language expert, what the one-line refusal says (None: answers)
    "redos-target-modules": ("evil/redos-lora", "evil/lang-lora", "target_modules is not a plain list of module"),
    "lora-alpha-NaN": ("evil/nan-lora", "evil/lang-lora", "NaN is not a JSON number"),
    "config-100k-brackets": ("evil/deep-config", "evil/lang", "more than 64 levels of nested brackets"),
    "tokenizer-66MB": ("evil/big-tokenizer", "evil/lang", "its tokenizer.json is [0-9,]+ bytes, more than the 1,048,576"),
    "chat-template-never-rendered": ("evil/template", "evil/lang", None),
}


@pytest.mark.parametrize("case", sorted(PAGE_CASES))
def test_a_hostile_hub_repo_is_refused_on_the_hosted_page(hostile_page, case):
    """Issue 41 hosted: each hostile repo named on the page (Load, then Ask) is refused with one line within
    `SECONDS` of the call (plus the page's own latency) and `GROWTH_MB` over the warmed-up server's peak; the chat
    template nobody asked for is never rendered (Ask answers)."""
    import time

    from gradio_client import Client
    from gradio_client.exceptions import AppError

    url, pid, peak0 = hostile_page
    math, lang, match = PAGE_CASES[case]
    c = Client(url, verbose=False)
    t0 = _cpu_seconds(pid)
    with pytest.raises(AppError) if match else __import__("contextlib").nullcontext() as e:
        c.submit("evil/base", math, lang, False, api_name="/load").result(timeout=30)
        answers = _page_ask(c)
    took, grown = _cpu_seconds(pid) - t0, _status_mb(pid, "VmHWM") - peak0
    print(f"\n{case}: {took:.1f} s, server peak +{grown:.0f} MB")
    assert grown < GROWTH_MB
    if match is None:
        assert took < 60 and "2+2?" in str(answers), answers
        return
    msg = str(e.value)
    assert re.search(match, msg) and "\n" not in msg.strip() and "Traceback" not in msg, msg
    assert took < SECONDS + 3, took


@pytest.mark.parametrize("text,why", [
    (DEEP, "more than 64 levels of nested brackets"),
    ("[" * 65 + "]" * 65, "more than 64 levels"),
    ('{"a": NaN}', "NaN is not a JSON number"),
    ('{"a": [1, -Infinity]}', "-Infinity is not a JSON number"),
    ("[" + ",".join(["{}"] * 1_000_001) + "]", "1,000,002 arrays and objects, at most 1,000,000"),
    ("[1," + " " * (16 * 2**20) + "2]", "bytes; at most 16,777,216 are read"),
    ('{"a": 1', "Expecting ',' delimiter"),
    ("\xff", "not valid JSON"),
])
def test_a_model_json_is_read_strictly_in_one_line(tmp_path, text, why):
    """Every JSON a model brings goes through `jsonfile.read_json`: size, depth and count of arrays and objects
    bounded before parsing (fast, small), NaN and Infinity refused, every failure one line naming the file."""
    import time

    from layerswap.core.jsonfile import read_json

    f = tmp_path / "config.json"
    f.write_bytes(text.encode("latin-1") if text == "\xff" else text.encode())
    t0 = time.process_time()
    with pytest.raises(UserError, match=re.escape(why)) as e:
        read_json(f)
    assert str(e.value).startswith(str(f)) and "\n" not in str(e.value) and time.process_time() - t0 < 2


def test_brackets_and_escapes_inside_strings_are_not_nesting(tmp_path):
    from layerswap.core.jsonfile import read_json

    value = {"template": "{% for m in messages %}[[[[" * 100 + '\\"[' * 50 + "\\\\", "x": [[1]], "y": "]]]}}}" * 100}
    (tmp_path / "c.json").write_text(json.dumps(value))
    assert read_json(tmp_path / "c.json") == value
# ---- weights whose header lies about where the bytes are (issue 39) --------------------------------------------

def _shared_bytes(src: Path, dst: Path) -> tuple[str, str]:
    """`src`'s model with layer 1's q_proj pointing at layer 0's q_proj bytes, its own bytes cut out and every later
    tensor moved down: each range in bounds and the size its shape needs, the data covered exactly, one overlap."""
    from layerswap.models.tensorfile import read_header

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
