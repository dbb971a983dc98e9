"""Tiny Llama checkpoints built offline: the app's fallback demo models and the tests' fixtures.

`make_tiny_llama` writes a random-init ``LlamaForCausalLM`` as safetensors plus a byte-level BPE
tokenizer trained locally with `tokenizers`, in the standard Hugging Face layout. These models
are untrained: their answers are noise. The trained demo organism (``assets/demo``), when
present, is the app's default instead; `recommended_plan` and `organism_summary` read the plan
chosen on its dev set and a one-line summary of its measured numbers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from layerswap.shipped.results import DICTIONARY, PLAN_FIELDS, SAME_WEIGHTS, SKILL_FLOOR, Results, results_file
from layerswap.core.errors import UserError
from layerswap.recipe.plans import Plan
from layerswap.models.presets import assets_dir




_CORPUS = """
Question: Roger has 5 tennis balls. He buys 2 more cans of tennis balls. Each can has 3 tennis balls.
How many tennis balls does he have now? Step-by-Step Answer: Roger started with 5 balls. 2 cans of 3
tennis balls each is 6 tennis balls. 5 + 6 = 11. The answer is 11.
There were nine computers in the server room. Five more computers were installed each day, from
monday to thursday. How many computers are now in the server room? 4 * 5 = 20. 9 + 20 = 29.
Swali: Jibu la Hatua kwa Hatua: Jibu ni 29. Frage: Die Antwort lautet 12. Pregunta: La respuesta es 7.
Question : Réponse étape par étape : La réponse est 8. 問題：答えは5です。 问题：答案是 6。
Задача: Ответ — 9. প্রশ্ন: উত্তর হল 11। ప్రశ్న: సమాధానం 4 โจทย์: คำตอบคือ 3
The quick brown fox jumps over the lazy dog. A farmer sells eggs at the market for $2 each.
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 30 40 50 60 70 80 90 100 1000 2,125
"""


def build_tokenizer(corpus: str = _CORPUS, vocab_size: int = 512, chat_template: str | None = None):
    """A byte-level BPE tokenizer (encodes any text) trained on `corpus`, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([corpus], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat_template:
        fast.chat_template = chat_template
    return fast


def make_tiny_llama(out: str | os.PathLike, *, layers: int = 4, hidden: int = 64, heads: int = 2,
                    kv_heads: int | None = None, intermediate: int | None = None, seed: int = 0,
                    dtype: torch.dtype = torch.float32, tokenizer=None, tie_embeddings: bool = False,
                    architecture: str = "llama", max_positions: int = 2048) -> Path:
    """Write a random-init tiny Llama (or Mistral/Qwen2) checkpoint with a tokenizer to `out`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out)
    tokenizer = tokenizer or build_tokenizer()
    cfg = AutoConfig.for_model(
        architecture,
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def perturb(src: str | os.PathLike, out: str | os.PathLike, *, scale: float = 0.02, seed: int = 1) -> Path:
    """Copy a checkpoint, adding Gaussian noise of relative size `scale` to every tensor.

    Gives "experts" that share the base's shapes and stay close to it, like a light fine-tune.
    """
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    shutil.copytree(src, out, dirs_exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for f in sorted(out.glob("*.safetensors")):
        sd = load_file(f)
        for k, v in sd.items():
            x = v.float()
            noise = torch.randn(x.shape, generator=g) * (x.std() if x.numel() > 1 else x.abs() + 1e-3) * scale
            sd[k] = (x + noise).to(v.dtype)
        save_file(sd, f, metadata={"format": "pt"})
    return out


def build_random_demo(root: str | os.PathLike, *, layers: int = 8) -> dict[str, Path]:
    """Untrained stand-in trio (base, math, lang) for when no trained demo is available.

    hidden 256 with 4 heads keeps head_dim at 64, which vLLM's CPU attention needs.
    """
    root = Path(root)
    marker = root / "layerswap-demo.json"
    paths = {r: root / r for r in ("base", "math", "lang")}
    if marker.exists():
        return paths
    tmp = root.parent / f".{root.name}.building"
    shutil.rmtree(tmp, ignore_errors=True)
    tok = build_tokenizer(vocab_size=768)
    make_tiny_llama(tmp / "base", layers=layers, hidden=256, heads=4, intermediate=512, seed=0, tokenizer=tok)
    perturb(tmp / "base", tmp / "math", scale=0.02, seed=1)
    perturb(tmp / "base", tmp / "lang", scale=0.02, seed=2)
    (tmp / "layerswap-demo.json").write_text(json.dumps({"kind": "random", "layers": layers}))
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(root)
    return paths


DEFAULT_ORGANISM = "demo"  # the organism under assets/ that the app, the CLI's defaults and the summaries use


def default_organism() -> Path:
    return assets_dir() / DEFAULT_ORGANISM


def demo_paths(cache: str | os.PathLike | None = None) -> tuple[dict[str, Path], str]:
    """The default models: the trained organism (`DEFAULT_ORGANISM`) if shipped, else untrained ones.

    Returns ``(paths, label)``; `label` is shown in the UI so nobody mistakes demo models for real ones.
    """
    demo = default_organism()
    if all((demo / r / "config.json").exists() for r in ("base", "math", "lang")):
        return {r: demo / r for r in ("base", "math", "lang")}, "demo organism (tiny models trained on a synthetic two-language world)"
    from layerswap.models.cache import cache_dir

    cache = Path(cache) / "random-demo-v1" if cache else cache_dir("random-demo-v1")
    return build_random_demo(cache), "untrained demo models (random weights, answers are noise)"


def demo_refs() -> tuple[dict[str, str], str, str, "Plan | None"]:
    """The default models as references the page may show: ``assets:demo/...`` when the organism is
    shipped (else the untrained models' folders), their label, a one-line summary of what they show
    (with its measured numbers, from the card's results) and the recommended plan (if shipped)."""
    from layerswap.models.presets import ASSETS_PREFIX

    paths, label = demo_paths()
    root = default_organism()
    if paths["math"] != root / "math":
        return {r: str(p) for r, p in paths.items()}, label, "", None
    refs = {r: f"{ASSETS_PREFIX}{DEFAULT_ORGANISM}/{r}" for r in paths}
    try:
        return refs, label, organism_summary() + " The card is one click below.", recommended_plan()
    except UserError:  # not measured yet: the page opens on the default plan
        return refs, label, "", None


def card_markdown(demo: str | os.PathLike | None = None) -> str:
    """The organism's card (``README.md``) for the page: links to repository files become plain names (the
    page cannot serve them); on a Space, a link to the card's file on the Hub comes first."""
    root = Path(demo or default_organism())
    text = (root / "README.md").read_text()
    text = re.sub(r"^---\n.*?\n---\n", "", text, flags=re.S).lstrip()  # front matter, if any
    text = re.sub(r"!\[[^\]]*\]\((?!https?:)[^)]*\)\n?", "", text)  # figures in the repository
    text = re.sub(r"\[([^\]]+)\]\((?!https?:)[^)]*\)", r"\1", text)
    space = os.environ.get("SPACE_ID", "")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", space):
        rel = root.resolve().relative_to(assets_dir().resolve()).as_posix()
        text = f"[This card on the Hub](https://huggingface.co/spaces/{space}/blob/main/assets/{rel}/README.md)\n\n" + text
    return text


def demo_mgsm_dir() -> Path | None:
    d = default_organism() / "mgsm"
    return d if d.exists() else None


# ---- the trained organism's recommended plan and what it shows (its measurements: `demo_results`) ----------

def recommended_plan(demo: str | os.PathLike | None = None) -> Plan:
    """The plan `scripts/eval_demo.py` chose on the organism's dev set (``recommended_plan.json``)."""
    path = Path(demo or default_organism()) / "recommended_plan.json"
    if not path.exists():
        raise UserError(f"{path} is missing: run `python scripts/eval_demo.py` to measure the demo organism.")
    raw = json.loads(path.read_text())
    return Plan(**{k: raw[k] for k in PLAN_FIELDS})


def organism_summary(demo: str | os.PathLike | None = None) -> str:
    """One line: what the organism shows on its test set, with the measured numbers (its `Results`)."""
    root = Path(demo or default_organism())
    res = Results.read(results_file(root))
    t, rec = res.target, res.recommended
    name = _language_name(root, t)
    pct = lambda n: f"{100 * res.score(n, t).acc:.1f} %"  # noqa: E731
    s = res.score(rec, t)
    same_as_task_arithmetic = res.weight_difference("task arithmetic vs recommended plan") < SAME_WEIGHTS
    head = (f"{name} test set (n={res.n}): the recommended plan "
            f"({res.plan_info['name']}) scores {pct(rec)} [{100 * s.lo:.1f}, {100 * s.hi:.1f}] "
            f"({100 * s.strict:.1f} % in {name}'s own answer format), task arithmetic "
            f"{pct('task arithmetic')}"
            + (" (the same model: the experts touch disjoint tensors)" if same_as_task_arithmetic else "")
            + f", the math expert {pct('math expert')}, the language expert {pct('language expert')}, a 50/50 soup "
            f"{pct('soup 50/50')}, TIES {pct('TIES (density 0.2)')}, a word-for-word dictionary with no training "
            f"{pct(DICTIONARY)} and arithmetic that always subtracts {pct(SKILL_FLOOR)}")
    if res.pair != "localised":  # a control pair beside the organism's own experts
        beats = res.paired("math expert").diff > 0
        return head + (f". A negative control: these experts were trained on every layer ({res.pair}), so "
                       + ("the swap still beats the math expert alone." if beats else
                          "nothing localises and no plan chosen on dev beats the math expert alone."))
    targets = res.targets()
    dictionary_fails = next(v for k, v in targets.items() if k.startswith("dictionary baseline"))
    if not dictionary_fails:
        un = Results.of_pair(root / "unlocalised")
        tail = (f"; experts trained on every layer (the negative control) reach "
                f"{100 * un.score(un.recommended, t).acc:.1f} %") if un is not None else ""
        return (head + f". A positive control for the tool, not evidence for the paper: {name} is a cipher of English, "
                "so the swap does what the dictionary does" + tail + ".")
    met, total = sum(targets.values()), len(targets)
    if res.paired("math expert").diff <= 0:  # the method does not work on this organism
        return head + (f"; it meets {met} of its {total} targets, and no plan chosen on dev beats the math expert "
                       "alone: a negative result for the method here (the card says why).")
    return head + f"; it meets {met} of its {total} targets" + (" (all)." if met == total else " (see the card).")


def _language_name(root: Path, code: str) -> str:
    from layerswap.evaluation import mgsm

    data = next((d / "mgsm" for d in (root, root.parent) if (d / "mgsm").is_dir()), None)  # a pair's organism's
    return mgsm.languages(data)[code].name


# ---- one pair of experts of an organism: the plan chosen for it, a question it answers ---------------------------

def measured_plan(experts: str | os.PathLike, language_expert: str = "lang") -> Plan | None:
    """The plan chosen on dev for that pair (its results file), or None when the pair was not measured."""
    res = Results.of_pair(experts, language_expert)
    return res.plan if res is not None else None


def showcase_question(experts: str | os.PathLike, language_expert: str = "lang") -> tuple[str, int] | None:
    """A question of the pair's target language to open Ask on: the first that the recommended plan answers
    right and the math expert alone gets wrong (what the swap adds), else the first the plan answers right;
    None when the pair was not measured or the plan answers none."""
    res = Results.of_pair(experts, language_expert)
    if res is None:
        return None
    t = res.target
    plan_right, math_right = res.correct(res.recommended, t), res.correct("math expert", t)
    ok = [i for i, c in enumerate(plan_right) if c == "1"]
    return (t, next((i for i in ok if math_right[i] == "0"), ok[0])) if ok else None
