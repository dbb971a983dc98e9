"""The command line's shared option groups, the library objects built from parsed options, and the
helpers several commands share (opening checkpoints, checking output files, printing a recipe, progress)."""

from __future__ import annotations

import argparse
import re
import sys
import textwrap

from layerswap.models.family import MAX_LANGS, Family, split_spec
from layerswap.models.pairing import BASE_DISTANCE_THRESHOLD
from layerswap.engines import EngineSettings
from layerswap.core.errors import UserError
from layerswap.recipe.fields import FIELDS
from layerswap.recipe.plans import parse_layers
from layerswap.recipe.recipes import Recipe
from layerswap.recipe.sources import Sources

DEVICE_HELP = "cpu, cuda or auto (default auto: cuda when torch sees a GPU)"


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parse_size(s: str) -> int:
    """'5GB', '500MB', '2G', '1000000' -> bytes (decimal units, like HF's max_shard_size)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B)?\s*", s.upper())
    if not m:
        raise UserError(f"Cannot read size {s!r}; write e.g. 5GB, 500MB or a number of bytes.")
    mult = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[m.group(2)]
    if m.group(3) == "IB":
        mult = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2)]
    return int(float(m.group(1)) * mult)


def int_list(spec: str, what: str) -> list[int]:
    """'0,1,2' or '0-3' (inclusive) -> sorted unique ints, each a possible layer count (`plans.parse_layers`)."""
    try:
        return list(parse_layers(spec))
    except UserError as e:
        raise UserError(f"{what}: {e}") from None


# ---- option groups ---------------------------------------------------------------------------------

def models(p: argparse.ArgumentParser, base_required: bool = False, optional: str = "", family: bool = False) -> None:
    """--math, --lang (required unless `optional` says what they are for) and --base. --lang takes REF or CODE=REF
    (the expert's MGSM language) and, where the command takes a family (`family`), repeats; `read_langs` reads it."""
    p.add_argument("--math", required=not optional, metavar="M", help=f"{optional}math expert: local folder or Hub id")
    p.add_argument("--lang", required=not optional, metavar="[CODE=]L", action="append",
                   help=f"{optional}language expert; CODE=L also says its MGSM language (then its questions are "
                        "the default --langs)" + (f"; repeat --lang CODE=L for a family of up to {MAX_LANGS} language "
                                                  "experts, one per code" if family else ""))
    p.add_argument("--base", required=base_required, metavar="B", help=f"{optional}base model both experts were tuned "
                   "from")
    p.set_defaults(takes_family=family, family=None)


def read_langs(args, cap: int = MAX_LANGS) -> None:
    """--lang as given (a list) -> `args.lang` (the one language expert's reference, or None for a family of
    several) and `args.family` (a `models.family.Family` when codes were given, else None). A single plain
    --lang REF stays exactly as it was; one CODE=REF also makes CODE the default --langs; several are a family,
    for the commands that take one (where one CODE=REF is a family of one)."""
    specs = getattr(args, "lang", None)
    if not isinstance(specs, list):
        return
    args.family = None
    codes = [split_spec(s)[0] for s in specs]
    if len(specs) == 1 and codes[0] is None:
        args.lang = split_spec(specs[0])[1]
        return
    if not args.takes_family and len(specs) > 1:
        raise UserError(f"layerswap {args.cmd} takes one language expert (--lang L or --lang CODE=L); a family of "
                        "several is evaluated with layerswap eval.")
    args.family = Family.parse(args.math or "", specs, args.base, cap=cap)
    args.lang = args.family.members[0].ref if len(specs) == 1 else None
    if len(specs) == 1 and not args.takes_family and hasattr(args, "langs") and not args.langs:
        args.langs = codes[0]


GROUPS = {"plan": "plan (defaults: the literature's b=5 u=2 tb=1 tu=1 at 32 layers, scaled to the model)",
          "maps": "other layer maps (ablations)",
          "method": "merge method (default layer_swap; the others are the paper's baselines)"}
_TYPES = {"int": int, "float": float}


def _field_options(p: argparse.ArgumentParser, *groups: str) -> None:
    """The recipe-field table's flags of these groups (`layerswap.recipe.fields`); values are read and bounded by
    `Recipe.from_values`, so argparse only converts numbers."""
    for group in groups:
        g = p.add_argument_group(GROUPS[group])
        for f in FIELDS:
            if f.group == group:
                g.add_argument(f.flag, dest=f.dest, type=_TYPES.get(f.kind, str), metavar=f.metavar,
                               choices=list(f.choices) if f.choices else None, help=f.help)


def plan_options(p: argparse.ArgumentParser) -> None:
    _field_options(p, "plan", "maps")


def method_options(p: argparse.ArgumentParser) -> None:
    _field_options(p, "method")


def recipe_options(p: argparse.ArgumentParser) -> None:
    """A merge recipe: a recipe file, or the layer map (plan) and the method as flags."""
    p.add_argument("--recipe", metavar="FILE",
                   help="the whole recipe from a YAML/JSON file (layerswap.recipe.recipes); replaces the plan and method flags")
    plan_options(p)
    method_options(p)


def pairing_options(p: argparse.ArgumentParser, force: bool = True) -> None:
    p.add_argument("--base-distance-threshold", type=float, default=BASE_DISTANCE_THRESHOLD,
                   help="largest sampled relative distance of an expert from the base before the pair is "
                        f"treated as not sharing it (default {BASE_DISTANCE_THRESHOLD})")
    if force:
        p.add_argument("--force", action="store_true", help="merge even if the experts seem not to share the base")


def eval_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("MGSM evaluation (lm-eval mgsm_native_cot protocol by default)")
    g.add_argument("--langs", help="comma list of MGSM language codes (default: the target languages of the models' "
                   "own set, for shipped models; else sw,te,bn,ja)")
    g.add_argument("--limit", type=int, help=f"first N questions per language (default: all of them; {shipped_sizes()})")
    g.add_argument("--shots", type=int, default=0, choices=[0, 1, 2, 3, 4, 5, 6, 7, 8],
                   help="few-shot exemplars from exemplars.json (default 0, as lm-eval; 8 for the 8-shot setup)")
    g.add_argument("--mode", choices=("native_cot", "direct"), default="native_cot",
                   help="lm-eval task family: mgsm_native_cot (default) or mgsm_direct")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--mgsm-dir", help=MGSM_DIR_HELP)


def shipped_sizes() -> str:
    """How many questions per language the shipped MGSM sets hold, counted from their files (for --limit's help)."""
    from layerswap.models.presets import assets_dir

    sizes = {}
    for tsv in sorted(assets_dir().glob("*/mgsm/mgsm_*.tsv")):
        with open(tsv, "rb") as f:
            sizes.setdefault(sum(1 for line in f if line.strip()), []).append(tsv.parent.parent.name)
    if not sizes:
        return "no shipped sets"
    def names(orgs: list[str]) -> str:
        orgs = list(dict.fromkeys(orgs))
        return orgs[0] if len(orgs) == 1 else f"{', '.join(orgs[:-1])} and {orgs[-1]}"

    return "; ".join(f"the shipped {names(orgs)} sets hold {n:,} per language" for n, orgs in sorted(sizes.items()))


MGSM_DIR_HELP = ("folder of mgsm_XX.tsv files, or a shipped set (assets:demo/mgsm); default: the models' own set "
                 "(shipped models), else $LAYERSWAP_MGSM_DIR, else the Hub")


def engine_options(p: argparse.ArgumentParser) -> None:
    """The engine flags, declared once for every command and the app (`EngineSettings.add_arguments`)."""
    EngineSettings.add_arguments(p.add_argument_group("engine"))


# ---- library objects from options -----------------------------------------------------------------

def recipe_from(args, num_layers: int) -> Recipe:
    """The recipe of a command: from --recipe FILE, or from the plan and method flags; the plan values not given
    come from the models' opening plan (`organisms.opening_plan`: a shipped pair's recommended plan, else the
    literature's, scaled)."""
    given = {f: getattr(args, f.dest) for f in FIELDS if getattr(args, f.dest, None) is not None}
    if getattr(args, "recipe", None):
        if given:
            raise UserError(f"--recipe {args.recipe} already says the whole recipe; drop "
                            f"{', '.join(f.flag for f in given)} (or edit the file).")
        r = Recipe.load(args.recipe)
        r.validate(num_layers)
        return r
    return Recipe.from_values(num_layers=num_layers, defaults=opening(args, num_layers).plan,
                              **{f.name: v for f, v in given.items()})


def opening(args, num_layers: int):
    """The plan the models open on (`organisms.opening_plan`) and why."""
    from layerswap.shipped.organisms import opening_plan

    return opening_plan((args.base or "", args.math or "", args.lang or ""), num_layers)


def plan_note(args, num_layers: int) -> str | None:
    """Which plan a command used when no plan flag and no recipe said one (None when they did)."""
    if getattr(args, "recipe", None) or any(getattr(args, f.dest, None) is not None for f in FIELDS if f.plan):
        return None
    return opening(args, num_layers).why


def test_data(args, *refs: str | None) -> None:
    """Fill in the MGSM set the command uses (--mgsm-dir, else the set the models bring: `organisms.test_set`)
    and, for --langs left out, that set's target languages (every language but English) or the paper's."""
    from layerswap.evaluation import mgsm
    from layerswap.shipped.organisms import test_set

    if not getattr(args, "mgsm_dir", None):
        own = test_set(*refs)
        args.mgsm_dir = str(own) if own is not None else None
    if hasattr(args, "langs") and not args.langs:
        have = mgsm.available_languages(args.mgsm_dir) if args.mgsm_dir else []
        targets = [c for c in have if c != "en"] or have
        args.langs = ",".join(targets) if args.mgsm_dir else ",".join(mgsm.PAPER_LANGS)


def data_inputs(args) -> tuple[str, ...]:
    """The MGSM folder a command reads, as an input no output may land in (none for the Hub)."""
    from layerswap.evaluation.mgsm import folder

    source = folder(getattr(args, "mgsm_dir", None))
    return (str(source),) if source is not None and source.is_dir() else ()


def open_checkpoint(ref: str | None):
    from layerswap.models.checkpoints import Checkpoint

    return Checkpoint.open(ref) if ref else None


def open_trio(args):
    """--math, --lang, --base opened (base first, so adapters given as experts merge into it)."""
    from layerswap.models.adapters import open_expert

    base = open_checkpoint(args.base)
    return open_expert(args.math, args.base), open_expert(args.lang, args.base), base


def check_outputs(outs, *checkpoints, extra=()) -> None:
    """Refuse file outputs that are, or sit inside, an input, before any long work starts."""
    from layerswap.merge.outputs import check_output_file, input_paths

    inputs = input_paths(*checkpoints, extra=extra)
    for out in outs:
        if out and out != "-":
            check_output_file(out, inputs)


def print_recipe(recipe: Recipe, num_layers: int, why: str | None = None, file=None) -> None:
    """The recipe as the command runs it; `why`: where a plan no flag gave comes from (`plan_note`); `file`: where
    to (stdout unless given; `eval` keeps its stdout for the table)."""
    if recipe.plan is not None:
        print(f"plan: {recipe.plan.title()} ({num_layers} layers)" + (f": {why}" if why and recipe.method.spec.uses_plan
                                                                         else ""), file=file)
        print(textwrap.indent(Sources(recipe, num_layers).describe(), "  "), file=file)
    else:
        print(f"method: {recipe.method.describe()}", file=file)


def engine_settings(args, chat_template: bool | None = False) -> EngineSettings:
    """The engine options as `EngineSettings` (`EngineSettings.from_args`; `chat_template`: the default when
    --chat-template is not given)."""
    return EngineSettings.from_args(args, chat_template)


def workbench(args, chat_template: bool | None = False):
    """The session behind ask and eval, from the engine options (`Workbench.from_settings`)."""
    from layerswap.serving.workbench import Workbench

    return Workbench.from_settings(engine_settings(args, chat_template))


def eval_config(args):
    """The evaluation settings, with every data problem (missing TSV, exemplars) raised before any model loads."""
    from layerswap.evaluation.run import EvalConfig, build_prompts

    cfg = EvalConfig(langs=[c.strip() for c in args.langs.split(",") if c.strip()], limit=args.limit,
                     shots=args.shots, mode=args.mode, max_new_tokens=args.max_new_tokens, source=args.mgsm_dir)
    cfg.validate()
    for code in cfg.langs:
        build_prompts(code, cfg)
    return cfg


class Bar:
    """The one progress display: a tqdm bar on stderr fed by `progress(fraction, text)` callbacks
    (hidden with -q, and when stderr is not a terminal)."""

    def __init__(self, enabled: bool = True):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=1000, disable=None if enabled else True, file=sys.stderr,
                        bar_format="{l_bar}{bar}| {elapsed}<{remaining}")

    def __call__(self, frac: float, desc: str) -> None:
        self.bar.set_description_str(desc[:60])
        self.bar.update(int(frac * 1000) - self.bar.n)

    def done(self) -> None:
        self.bar.close()
