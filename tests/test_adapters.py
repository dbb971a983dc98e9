"""PEFT adapters as experts (LoRA, IA3, prefix tuning): densified into their base (given or their own), cached,
refused clearly; a swap done on two adapters of one kind equals the densified swap (tolerances below)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from layerswap import Checkpoint, Plan, UserError
from layerswap.models.adapters import open_expert, prefix_of, read_adapter
from layerswap.merge.merging import export_adapter_merge, export_merge, merge_in_memory
from safetensors.torch import save_file
from tests.helpers import DEMO, DEMO_MGSM, assert_matches_plan, expected_weight, make_adapter, read_dir

# The merged adapter applied to the base vs the swap of the densified experts, float32: weights (LoRA, IA3)
# and logits (prefix tuning, which has no weights to compare) agree to within these.
WEIGHT_TOL = 1e-6
LOGIT_TOL = 1e-4


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, trio):
    """A tiny LoRA adapter on the base, built locally with peft, with non-zero B matrices."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora")
    model = AutoModelForCausalLM.from_pretrained(trio["base"])
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    peft_model.save_pretrained(root / "adapter")
    merged = peft_model.merge_and_unload()
    return root / "adapter", merged.state_dict()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, trio):
    """Per kind, a math and a language adapter on the base: math on layers 1-4 with full copies of the final norm
    and lm_head, language on every layer (LoRA: and the embeddings) with a full copy of the embeddings."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for kind in ("lora", "ia3", "prefix"):
        out[kind] = {
            "math": make_adapter(trio["base"], root / f"math_{kind}", kind, 1, layers=range(1, 5),
                                 full=("model.norm", "lm_head")),
            "lang": make_adapter(trio["base"], root / f"lang_{kind}", kind, 2, embed=True,
                                 full=() if kind == "lora" else ("model.embed_tokens",)),
        }
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSWAP_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_lora_adapter_as_language_expert(adapter, trio, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSWAP_CACHE", str(tmp_path / "cache"))
    adir, expected = adapter
    lang = open_expert(adir, trio["base"])
    assert lang.adapter == str(adir) and lang.adapter_kind == "lora"
    on_disk = read_dir(lang.path)
    for k, v in expected.items():
        if k in on_disk:
            assert torch.equal(on_disk[k], v), k  # peft's merge_and_unload, saved as safetensors
    assert not torch.equal(on_disk["model.layers.0.self_attn.q_proj.weight"],
                           read_dir(trio["base"])["model.layers.0.self_attn.q_proj.weight"])
    # through the CLI, the adapter merges into --base and is then an ordinary expert
    plan = Plan(b=1, u=1, tb=1, tu=1)
    r = subprocess.run([sys.executable, "-m", "layerswap.cli", "merge", "--math", str(trio["math"]),
                        "--lang", str(adir), "--base", str(trio["base"]), "--b", "1", "--u", "1", "--tb", "1",
                        "--tu", "1", "-o", str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "LAYERSWAP_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    assert_matches_plan(tmp_path / "out", {"math": trio["math"], "lang": lang.path}, plan)
    # the merged adapter is cached: opening again reuses it
    assert open_expert(adir, trio["base"]).path == lang.path


def test_adapter_without_a_known_base(tmp_path, adapter):
    adir = tmp_path / "a"
    shutil.copytree(adapter[0], adir)
    cfg = json.loads((adir / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = None
    (adir / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="does not name its base model; pass --base"):
        open_expert(adir)
    with pytest.raises(UserError, match="is a PEFT adapter, not a full model"):
        Checkpoint.open(adir)
    cfg["peft_type"] = "ADALORA"
    (adir / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="ADALORA adapter; layerswap reads LoRA, IA3 and prefix-tuning"):
        open_expert(adir, adapter[0])


@pytest.mark.parametrize("kind", ["ia3", "prefix"])
def test_ia3_and_prefix_adapters_load_as_experts(kind, pairs, trio, cache):
    """IA3 densifies like peft's merge_and_unload; a prefix expert is the base with its full copies, plus the prefix."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adir = pairs[kind]["math"]
    ck = open_expert(adir)  # the adapter names its own base
    assert ck.adapter_kind == kind and ck.adapter_base == str(trio["base"].resolve())
    got, base = read_dir(ck.path), read_dir(trio["base"])
    if kind == "ia3":
        want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trio["base"]), str(adir)
                                         ).merge_and_unload().state_dict()
        assert all(torch.equal(got[k], want[k]) for k in got)
        assert prefix_of(ck) is None
    else:
        changed = {k for k in got if not torch.equal(got[k], base[k])}
        assert changed == {"model.norm.weight", "lm_head.weight"}  # only the full copies: a prefix is no weight
        table = prefix_of(ck)
        cfg = json.loads((adir / "adapter_config.json").read_text())
        assert tuple(table.shape) == (cfg["num_virtual_tokens"], ck.num_layers * 2 * cfg["token_dim"])


def _densified_swap(pair, base, plan, out):
    """The swap of the two experts densified (each a full model; a prefix expert's weights), as a full model."""
    cks = [open_expert(pair[r]) for r in ("math", "lang")]
    if cks[0].adapter_kind != "prefix":
        export_merge(*cks, plan, out, base=Checkpoint.open(base), force=True)
        return cks
    with pytest.raises(UserError, match="Prefix-tuning experts cannot be densified"):
        export_merge(*cks, plan, out, base=Checkpoint.open(base), force=True)
    sd = merge_in_memory(read_dir(cks[0].path), read_dir(cks[1].path), cks[0].num_layers, plan)
    shutil.copytree(cks[0].path, out)
    for f in out.glob("*.safetensors"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    return cks


@pytest.mark.parametrize("kind", ["lora", "ia3"])
def test_swap_on_adapters_equals_the_densified_swap(kind, pairs, trio, cache, tmp_path):
    """Blended transition layers, a reverted layer and full copies: the merged adapter, loaded by peft and merged
    into the base, is the densified experts' swap within WEIGHT_TOL."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    plan = Plan(b=1, u=1, tb=1, tu=1, revert=(3,))
    cks = _densified_swap(pairs[kind], trio["base"], plan, tmp_path / "dense")
    out = export_adapter_merge(*cks, plan, tmp_path / "adapter", base=Checkpoint.open(trio["base"]), force=True)
    ad = read_adapter(out)
    assert ad.kind == kind and json.loads((out / "layerswap.json").read_text())["adapter"]["kind"] == kind
    card = (out / "README.md").read_text()
    assert f"{'LoRA' if kind == 'lora' else 'IA3'} adapter** (PEFT)" in card and "PEFT adapter merged into" in card
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trio["base"]), str(out)).merge_and_unload()
    got, want = model.state_dict(), read_dir(tmp_path / "dense")
    err = max((got[k] - want[k]).abs().max().item() for k in want)
    print(f"{kind}: max |merged adapter applied - densified swap| = {err:.2e}")
    assert err <= WEIGHT_TOL
    base = read_dir(trio["base"])
    assert all(torch.equal(got[k], base[k]) for k in base if ".layers.3." in k)  # the reverted layer is the base's
    if kind == "lora":  # blended layers hold both pairs side by side (rank 4 + 4)
        assert ad.config["r"] == 8 and ad.config["lora_alpha"] == 8


def test_prefix_swap_matches_per_layer_prefixes(pairs, trio, cache, tmp_path):
    """The merged prefix adapter through peft gives the logits of the densified swap's weights run with each
    layer's keys and values taken (or blended) from the expert the plan names, built here by hand."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, DynamicCache

    plan = Plan(b=1, u=1, tb=1, tu=1)
    cks = _densified_swap(pairs["prefix"], trio["base"], plan, tmp_path / "dense")
    out = export_adapter_merge(*cks, plan, tmp_path / "adapter", base=Checkpoint.open(trio["base"]), force=True)
    card = (out / "README.md").read_text()
    assert "prefix-tuning adapter** (PEFT)" in card and "a PEFT prefix-tuning adapter on `base`" in card
    ids = torch.tensor([[1, 5, 9, 14, 3, 7, 22]])
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trio["base"]), str(out)).eval()
    with torch.no_grad():
        got = peft_model(input_ids=ids).logits
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "dense").eval()
    tables = [prefix_of(ck) for ck in cks]
    L, (P, cols) = cks[0].num_layers, tables[0].shape
    heads = dense.config.num_key_value_heads
    width = cols // (2 * L)
    cache_ = DynamicCache()
    for i in range(L):
        w = expected_weight(f"model.layers.{i}.self_attn.k_proj.weight", plan, L)
        kv = [((1 - w) * tables[0][:, j * width:(j + 1) * width] + w * tables[1][:, j * width:(j + 1) * width])
              .view(1, P, heads, width // heads).transpose(1, 2) for j in (2 * i, 2 * i + 1)]
        cache_.update(kv[0], kv[1], i)
    with torch.no_grad():
        want = dense(input_ids=ids, attention_mask=torch.ones(1, P + ids.shape[1], dtype=torch.long),
                     past_key_values=cache_).logits
    with torch.no_grad():
        assert (dense(input_ids=ids).logits - want[:, :]).abs().max() > 1e-2  # the prefixes change the answer
    err = (got - want).abs().max().item()
    print(f"prefix: max |logits, merged adapter - per-layer prefixes| = {err:.2e}")
    assert err <= LOGIT_TOL


def test_swaps_on_adapters_refused_with_the_reason(pairs, trio, cache, tmp_path):
    base = Checkpoint.open(trio["base"])
    pm, pl = (open_expert(pairs["prefix"][r]) for r in ("math", "lang"))
    with pytest.raises(UserError, match="reverted to the base, which has no prefix"):
        export_adapter_merge(pm, pl, Plan(b=1, u=1, tb=0, tu=0, revert=(2,)), tmp_path / "a", base=base, force=True)
    short = make_adapter(trio["base"], tmp_path / "short", "prefix", 3, tokens=2)
    other = make_adapter(trio["base"], tmp_path / "other", "prefix", 4, tokens=2)
    # the same weights (the base's: no full copies), other prefixes: other experts to a results file's keys
    a, b = read_dir(open_expert(short).path), read_dir(open_expert(other).path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert open_expert(short).content_id() != open_expert(other).content_id()
    with pytest.raises(UserError, match="prefixes differ in shape"):
        export_adapter_merge(pm, open_expert(short), Plan(b=1, u=1, tb=0, tu=0), tmp_path / "b", base=base, force=True)
    with pytest.raises(UserError, match="cannot be densified beside a full model"):
        export_adapter_merge(pm, Checkpoint.open(trio["lang"]), Plan(b=1, u=1, tb=0, tu=0), tmp_path / "c",
                             base=base, force=True)
    lm, ll = (open_expert(pairs["lora"][r]) for r in ("math", "lang"))
    from layerswap.recipe.recipes import Recipe

    with pytest.raises(UserError, match="is a merge method, with no per-module source"):
        export_adapter_merge(lm, ll, Recipe.from_values(method="soup"), tmp_path / "d", base=base, force=True)
    assert not any((tmp_path / x).exists() for x in "abcd")


ORGANISM = DEMO / "ablation"


@pytest.mark.parametrize("forward", ["memory", "stream"])
def test_prefix_experts_answer_and_run_the_lens_as_peft_runs_them(forward, cache, tmp_path):
    """The organism's prefix-tuning experts (assets/demo/ablation): the workbench's engines (the merged one built
    on the adapters) and the lens give peft's own tokens and probabilities for the expert and the exported swap."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from layerswap.evaluation import mgsm
    from layerswap.analysis.lens import LensConfig, run_lens
    from layerswap.serving.workbench import Workbench

    m, l, base = ORGANISM / "math_prefix", ORGANISM / "lang_prefix", DEMO / "base"
    plan = Plan(b=2, u=0, tb=1, tu=0)
    out = export_adapter_merge(open_expert(m), open_expert(l), plan, tmp_path / "swap", force=True)
    res = run_lens(str(m), str(l), plan, base=str(base), config=LensConfig("xx", index=5, batch=2, source=DEMO_MGSM),
                   device="cpu", forward=forward)
    for role, adir in (("math", m), ("merged", out)):
        ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adir)).eval()
        ids = AutoTokenizer.from_pretrained(m)(res.prompt)
        with torch.no_grad():
            p = torch.softmax(ref(input_ids=torch.tensor([ids["input_ids"]])).logits[0, -1].double(), -1)
        top = res.models[role].layers[-1]
        assert top.top_ids[0] == int(p.argmax()) and top.top[0][1] == pytest.approx(float(p.max()), abs=1e-4)
    if forward == "stream":
        return
    wb = Workbench(engine="auto")
    wb.load(str(m), str(l), str(base), force=True)
    assert wb.engine_plan.engine == "transformers" and "vLLM serves no prefix-tuning" in wb.engine_plan.why
    wb.build(plan)
    prompt = mgsm.prompt_for("xx", index=3, source=DEMO_MGSM).prompt
    for role, adir in (("math", m), ("merged", out)):
        eng = wb.engines[role]
        ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adir)).eval()
        enc = eng.tokenizer([eng.format(prompt)], return_tensors="pt", add_special_tokens=eng.add_special_tokens)
        row = ref.generate(**enc, max_new_tokens=24, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
        assert eng.generate([prompt], max_new_tokens=24)[0] == eng.decode(row, []), role
    batch = [mgsm.prompt_for("xx", index=i, source=DEMO_MGSM).prompt for i in (3, 11, 40)]  # left-padded batch
    eng = wb.engines["merged"]
    assert eng.generate(batch, max_new_tokens=24) == [eng.generate([q], max_new_tokens=24)[0] for q in batch]


def test_cli_merge_adapter_writes_a_peft_folder(pairs, trio, cache, tmp_path):
    """`layerswap merge --adapter`: a LoRA swap as a PEFT folder with its card; two prefix-tuning experts, whose swap
    exists only on the adapters, export as an adapter without --adapter (the CLI and the workbench alike)."""
    from tests.helpers import run_cli

    env_args = ["--base", str(trio["base"]), "--b", "1", "--u", "1", "--tb", "1", "--tu", "0", "--force"]
    r = run_cli("merge", "--math", str(pairs["lora"]["math"]), "--lang", str(pairs["lora"]["lang"]), *env_args,
                "--adapter", "-o", str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr
    ad = read_adapter(tmp_path / "a")
    assert ad.kind == "lora" and "LoRA adapter** (PEFT)" in (tmp_path / "a" / "README.md").read_text()
    r = run_cli("merge", "--math", str(pairs["prefix"]["math"]), "--lang", str(pairs["prefix"]["lang"]), *env_args,
                "-o", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    assert read_adapter(tmp_path / "b").kind == "prefix" and "exists only on the adapters" in r.stdout
    from layerswap.recipe.recipes import Recipe
    from layerswap.serving.workbench import Workbench

    wb = Workbench()
    wb.check(str(pairs["prefix"]["math"]), str(pairs["prefix"]["lang"]), str(trio["base"]), force=True)
    out = wb.export(tmp_path / "c", recipe=Recipe.from_values(b=1, u=1, tb=1, tu=0))
    assert read_adapter(out).kind == "prefix"


def test_the_page_takes_adapter_experts_and_exports_the_swap_as_an_adapter(app_url, tmp_path):
    """As a visitor: the organism's prefix-tuning and LoRA experts load (Force: the LoRA math expert moves 0.74 from
    the base), answer in Ask (the merged prefix model gives peft's own answer to the exported swap), and Export as
    PEFT adapter writes a folder peft reads."""
    from gradio_client import Client
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from layerswap.evaluation import mgsm

    client = Client(app_url, verbose=False)
    plan = (2, 0, 0, 0)
    for kind in ("prefix", "lora"):
        report, *_ = client.predict("assets:demo/base", f"assets:demo/ablation/math_{kind}",
                                    f"assets:demo/ablation/lang_{kind}", True, api_name="/load")
        assert "compatible: LlamaForCausalLM, 8 layers" in report
        _, math_a, _, merged_a, *_ = client.predict("xx", 0, "", 16, *plan, api_name="/ask")
        assert math_a.startswith("**math expert**") and merged_a.startswith("**merged model**")
        msg, *_ = client.predict(str(tmp_path / kind), False, *plan, api_name="/export_adapter")
        assert f"a {kind} adapter (PEFT)" in msg and read_adapter(tmp_path / kind).kind == kind
        if kind == "prefix":
            ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DEMO / "base"), str(tmp_path / kind))
            tok = AutoTokenizer.from_pretrained(DEMO / "base")
            enc = tok(mgsm.prompt_for("xx", index=0, source=DEMO_MGSM).prompt, return_tensors="pt")
            row = ref.generate(**enc, max_new_tokens=16, do_sample=False)[0, enc["input_ids"].shape[1]:]
            first = tok.decode(row, skip_special_tokens=True).split("\n")[0].strip()
            assert first and first in merged_a


def test_a_sweep_records_why_a_prefix_pair_takes_no_merge_method(pairs, trio, cache, tmp_path):
    """Sweeps take adapter experts; a recipe the pair cannot take (a merge method on prefixes) is recorded as not
    run, with the reason, and the table says so; the swap beside it runs."""
    import yaml

    from layerswap.sweeps import run_sweep
    from layerswap.sweeps.report import table_text

    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "prefix", "expert_sets": [{"name": "prefix", "math": str(pairs["prefix"]["math"]),
                                           "lang": str(pairs["prefix"]["lang"]), "base": str(trio["base"]), "force": True}],
        "recipes": [{"name": "swap", "plan": {"b": 1, "u": 1, "tb": 1, "tu": 0}},
                    {"name": "soup", "method": {"name": "soup", "weight": 0.5}}],
        "test_sets": [{"path": str(DEMO_MGSM), "langs": ["en"]}], "include_experts": False,
        "eval": {"limit": 2, "max_new_tokens": 4}, "engine": {"engine": "transformers", "batch_size": 2}}))
    run = run_sweep(spec, tmp_path / "r.jsonl")
    rows = {r["name"]: r for r in run.rows}
    assert rows["swap"]["kind"] == "merge" and rows["swap"]["n"] == {"en": 2}
    assert rows["soup"]["kind"] == "not run" and "no per-module source" in rows["soup"]["message"]
    assert "soup: not run (Model soup is a merge method, with no per-module source)" in table_text(run.rows)


def test_cli_ask_and_lens_take_prefix_experts(cache, tmp_path, capsys):
    """`layerswap ask` and `layerswap lens` with the organism's prefix-tuning experts (the engine plan says why
    transformers runs them)."""
    from layerswap.cli import main as cli

    experts = ["--math", str(ORGANISM / "math_prefix"), "--lang", str(ORGANISM / "lang_prefix"), "--base",
               str(DEMO / "base"), "--b", "2", "--u", "0", "--tb", "0", "--tu", "0", "--mgsm-lang", "xx",
               "--index", "3", "--mgsm-dir", str(DEMO_MGSM)]
    assert cli(["ask", *experts, "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "merged" in out and "gold answer" in out
    js = tmp_path / "lens.json"
    assert cli(["lens", *experts, "--batch", "4", "--forward", "memory", "--json-out", str(js), "-o",
                str(tmp_path / "lens.html"), "-q"]) == 0
    assert set(json.loads(js.read_text())["models"]) >= {"math", "lang", "merged"}


def test_an_adapters_config_is_bounded_and_its_base_is_no_path_in_disguise(tmp_path, adapter):
    """Patterns are bounded before peft or layerswap match them; only an explicit ./ or ../ base is read from the
    adapter's own folder (a Hub id that happens to be a subfolder of it stays a Hub id)."""
    adir = tmp_path / "a"
    shutil.copytree(adapter[0], adir)
    cfg = json.loads((adir / "adapter_config.json").read_text())
    (adir / "owner" / "name").mkdir(parents=True)
    for ref, want in (("owner/name", "owner/name"), ("./owner/name", str((adir / "owner" / "name").resolve()))):
        (adir / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": ref}))
        assert read_adapter(adir).base_ref == want
    (adir / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": "(a|b)*" * 20_000}))
    with pytest.raises(UserError, match="target_modules is .* characters long"):
        read_adapter(adir)


def test_two_adapters_alike_but_for_their_bytes_densify_apart(tmp_path, monkeypatch):
    """Two shipped IA3 math experts share file names, sizes and headers; copied with equal mtimes (a tarball, a
    fresh clone within one clock tick) the densified-adapter cache must still tell them apart (issue 33's walk
    through the sweep files found 5-peft's 4x-steps expert answering as the 1x one)."""
    import os
    import shutil

    from layerswap.models.adapters import open_expert
    from layerswap.models.presets import assets_dir

    monkeypatch.setenv("LAYERSWAP_CACHE", str(tmp_path / "cache"))
    abl = assets_dir() / "demo" / "ablation"
    got = {}
    for name in ("math_ia3", "math_ia3_long"):
        shutil.copytree(abl / name, tmp_path / name)
        for f in (tmp_path / name).iterdir():
            os.utime(f, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
        ck = open_expert(tmp_path / name, assets_dir() / "demo" / "base")
        got[name] = ck.get("model.layers.4.mlp.down_proj.weight")
    assert not torch.equal(got["math_ia3"], got["math_ia3_long"])


# ---- module-name patterns (issue 41): only the shapes people write, so no pattern can hang `re` ----------------

SAFE = [r".*\.(q_proj|v_proj)", r"^.*(q_proj|v_proj)$", "q_proj", "model.layers.0.self_attn.q_proj",
        r".*\.layers\.(0|1)\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj|.*embed_tokens",
        r".*\.layers\.(2|3)\.(self_attn\.(k|v)_proj|mlp\.down_proj)", r"(?:q|v)_proj", r".*mlp\..*"[:-2] + "down_proj",
        r".*\.layers\.(" + "|".join(map(str, range(80))) + r")\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj"]
UNSAFE = {"(.*.*)*X": "repeats something", "^(([a-z._0-9])+)+$!": "is not part of a module name",
          ".*.*X": "repeats something", r"a\d+": r"escapes '\\d'", "(a|b)+": "repeats something",
          "(?=a)": "is not part of a module name", "a{2,}": "repeats something", "(a": "not closed",
          "(a|a|a|a|a|a|a|a)" * 3: "up to 512 of its names can match at one place",
          "(" + "|".join(["."] * 300) + ")": "more than 256 alternatives", "q_proj$x": "is not part of a module name",
          "a" * 20_000: "20,000 characters long", "(" * 40 + "a" + ")" * 40: "nest more than 16"}


@pytest.mark.parametrize("pattern", SAFE)
def test_plain_alternations_of_module_names_are_accepted(pattern):
    from layerswap.models.patterns import check_pattern

    assert check_pattern(pattern, "target_modules") == pattern


@pytest.mark.parametrize("pattern,why", UNSAFE.items(), ids=[k[:24] for k in UNSAFE])
def test_other_patterns_are_refused_with_what_to_write(pattern, why):
    from layerswap.models.patterns import check_pattern

    with pytest.raises(UserError, match="target_modules is not a plain list of module names") as e:
        check_pattern(pattern, "target_modules")
    assert why in str(e.value) and "a list such as" in str(e.value)


def test_every_shipped_adapter_and_every_peft_made_one_is_read(tmp_path, trio):
    """The shipped adapters (assets/demo/ablation) and those the tests make with peft keep working."""
    shipped = sorted(p.parent for p in (DEMO / "ablation").glob("*/adapter_config.json"))
    assert len(shipped) >= 8
    made = [make_adapter(trio["base"], tmp_path / k, k, seed=1, embed=k == "lora", full=("lm_head",))
            for k in ("lora", "ia3", "prefix")]
    for folder in [*shipped, *made]:
        assert read_adapter(folder).kind in ("lora", "ia3", "prefix")


def test_the_worst_accepted_patterns_match_in_milliseconds():
    """Patterns at the bound, built to backtrack (overlapping alternatives, wildcards), matched as peft does
    against 100 names of 60 characters that nearly match: bounded by routes x name length, well under a second;
    the shapes people write count few routes (80 layers spelt out: 2)."""
    import re
    import time

    from layerswap.models.patterns import check_pattern, pattern_routes

    assert pattern_routes(SAFE[-1]) == 2 and pattern_routes(SAFE[0]) == 1
    for worst in (".*" + "(a|aa)" * 6, ".*" + "(.|..)" * 6 + "b", ".*(" + "|".join(["."] * 64) + ")c"):
        assert pattern_routes(check_pattern(worst, "target_modules")) == 64
        t0 = time.process_time()
        for i in range(100):
            name = "a" * (59 - i % 3) + "b"
            re.fullmatch(worst, name + "x"), re.match(rf"(.*\.)?({worst})$", name + "x")
        assert time.process_time() - t0 < 0.5
