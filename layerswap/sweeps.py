"""Sweeps: many recipes merged with experts loaded once, each evaluated, every finished point kept on disk.

    run = run_sweep("assets/sweeps/1-counts.yaml", "results.jsonl", progress=print)
    rows = load_results("results.jsonl")          # also while a sweep runs, or after it was killed

`run_sweep` takes a sweep file or `SweepSpec` (`layerswap.sweepfiles`): for each expert set it
loads the experts once, evaluates them as reference rows, then merges each recipe in memory (or
refreshes the serving vLLM engine) and evaluates it on each test set. Each finished point is one
line appended to the results file and fsynced (`layerswap.sweeplog`) with its full recipe, the
experts' fingerprints and the evaluation settings; a rerun skips what the file holds, so an
interrupted sweep (Ctrl-C, SIGKILL, power loss mid-write) resumes without losing or repeating a
point. An expert set that cannot be merged (different shapes, or a different base without
``force``) is recorded as refused, with the reason. `evaluate_points` is the in-memory form for
scripts that want the per-question reports. `swap_grid` and `ablation_suite` build point lists
(the flag-based `layerswap sweep`); tables and plots are in `layerswap.sweepreport`.

Picking the best of many points on one test set is optimistic: report it as such, or select on
held-out questions (`EvalConfig.limit` / a separate split) and report on the rest.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from .cache import content_hash
from .errors import UserError
from .evaluation import EvalConfig, EvalReport
from .methods import MethodConfig
from .plans import Plan, default_plan
from .presets import portable_ref
from .recipes import Recipe
from .roles import EXPERTS, ROLE_NAMES
from .runtime import Progress, no_progress
from .sweepfiles import ExpertSet, SweepPoint, SweepSpec, TestSet, fit_points, load_spec
from .sweeplog import ResultsLog, load_results, point_key


def swap_grid(num_layers: int, b: Iterable[int], u: Iterable[int], t: Iterable[int] = (0, 1),
              transition: str = "flat", non_layer: str = "neighbour") -> list[SweepPoint]:
    """(b, u, tb = tu = t) swap plans that fit `num_layers`; (0, 0, 0) is the math expert itself."""
    points = []
    for bb in b:
        for uu in u:
            for tt in t:
                p = Plan(b=bb, u=uu, tb=tt, tu=tt, transition=transition, non_layer=non_layer)
                if bb + uu + 2 * tt <= num_layers and not (bb == uu == 0 and tt > 0):
                    points.append(SweepPoint(f"swap b={bb} u={uu} t={tt}", Recipe(plan=p),
                                             (("b", bb), ("u", uu), ("t", tt)), from_grid=True))
    if not points:
        raise UserError(f"No (b, u, t) in the grid fits the model's {num_layers} layers.")
    return points


def ablation_suite(num_layers: int, plan: Plan | None = None, seeds: Iterable[int] = (0, 1, 2),
                   with_base: bool = True) -> list[SweepPoint]:
    """The reviewers' ablations around `plan` (default: `default_plan`), plus the baselines."""
    p = plan or default_plan(num_layers)
    p.validate(num_layers)
    k = p.b + p.u  # swap as many layers elsewhere as the plan swaps at the ends
    pts = [
        SweepPoint(f"plan ({p.title()})", Recipe(plan=p)),
        SweepPoint("no transition zone", Recipe(plan=p.with_(tb=0, tu=0))),
        SweepPoint("transition: ramp", Recipe(plan=p.with_(transition="ramp"))),
        SweepPoint("transition: math only", Recipe(plan=p.with_(transition_weight=0.0))),
        SweepPoint("transition: language only", Recipe(plan=p.with_(transition_weight=1.0))),
        SweepPoint("bottom only", Recipe(plan=p.with_(u=0, tu=0))),
        SweepPoint("top only", Recipe(plan=p.with_(b=0, tb=0))),
        SweepPoint("attention only", Recipe(plan=p.with_(modules="attention"))),
        SweepPoint("MLP only", Recipe(plan=p.with_(modules="mlp"))),
        SweepPoint(f"middle {k} layers", Recipe(plan=Plan(kind="middle", k=k, non_layer="math"))),
        SweepPoint("inverse (language middle, math outer)",
                   Recipe(plan=Plan(kind="middle", k=num_layers - k, non_layer="math"))),
        SweepPoint("alternating", Recipe(plan=Plan(kind="alternating", non_layer="math"))),
    ]
    pts += [SweepPoint(f"random {k} layers, seed {s}", Recipe(plan=Plan(kind="random", k=k, seed=s, non_layer="math")))
            for s in seeds]
    pts.append(SweepPoint("soup 50/50", Recipe(MethodConfig("soup", weight=0.5))))
    if with_base:
        pts += [SweepPoint("task arithmetic", Recipe(MethodConfig("task_arithmetic"))),
                SweepPoint("TIES (density 0.2)", Recipe(MethodConfig("ties", density=0.2))),
                SweepPoint("DARE-TIES (drop 0.9)", Recipe(MethodConfig("dare_ties", drop_rate=0.9)))]
    return [pt for pt in pts if _fits(pt, num_layers)]


def _fits(pt: SweepPoint, num_layers: int) -> bool:
    try:
        pt.recipe.validate(num_layers)
        return True
    except UserError:
        return False


@dataclass
class SweepRow:
    name: str
    kind: str  # "expert" or "merge"
    recipe: dict
    accuracy: dict[str, dict[str, float]]  # metric -> lang -> accuracy (0..1)
    n: dict[str, int]
    layer_weights: list[float] | None = None
    report: EvalReport | None = field(default=None, repr=False)  # per-question outputs of this row

    def mean(self, metric: str = "flexible") -> float:
        vals = list(self.accuracy[metric].values())
        return sum(vals) / len(vals) if vals else float("nan")


@dataclass
class SweepResult:
    config: EvalConfig
    rows: list[SweepRow] = field(default_factory=list)
    cancelled: bool = False

    def merges(self) -> list[SweepRow]:
        return [r for r in self.rows if r.kind == "merge"]

    def best(self, metric: str = "flexible", lang: str | None = None) -> SweepRow:
        """The merge with the highest accuracy (mean over languages, or on `lang`). Optimistic."""
        merges = self.merges()
        if not merges:
            raise UserError("The sweep holds no merges yet.")
        return max(merges, key=lambda r: r.accuracy[metric][lang] if lang else r.mean(metric))

    def table(self, metric: str = "flexible") -> list[dict]:
        out = []
        for r in self.rows:
            row = {"recipe": r.name, "kind": r.kind}
            row.update({lang: round(100 * a, 1) for lang, a in r.accuracy[metric].items()})
            row["mean"] = round(100 * r.mean(metric), 1)
            row["n"] = sum(r.n.values())
            out.append(row)
        return out

    def table_text(self, metric: str = "flexible") -> str:
        rows = self.table(metric)
        head = ["recipe", *self.config.langs, "mean", "n"]
        lines = [" | ".join(head), " | ".join("---" for _ in head)]
        for r in rows:
            lines.append(" | ".join(str(r.get(h, "–")) for h in head))
        n = self.rows[0].n if self.rows else {}
        lines.append(f"(accuracy %, {metric} extraction; one standard error at 50% is "
                     + ", ".join(f"{lang} ±{50 / math.sqrt(max(c, 1)):.1f}" for lang, c in n.items()) + ")")
        return "\n".join(lines)


def _row(name: str, kind: str, recipe: dict, report: EvalReport, model: str, lw=None) -> SweepRow:
    acc = {m: {lang: report.accuracy(model, lang, m) or 0.0 for lang in report.config.langs}
           for m in ("flexible", "strict")}
    n = {lang: report.counts(model, lang) for lang in report.config.langs}
    return SweepRow(name, kind, recipe, acc, n, lw, report)


def evaluate_points(wb, points: list[SweepPoint], config: EvalConfig, *, include_experts: bool = True,
                    progress: Progress | None = None, cancel: threading.Event | None = None) -> SweepResult:
    """Merge and evaluate every point with the workbench's loaded experts, in memory (nothing on disk)."""
    config.validate()
    p = progress or no_progress
    result = SweepResult(config)
    steps = len(points) + (2 if include_experts else 0)
    step = 0

    def sub(f: float, d: str) -> None:
        p((step + f) / steps, d)

    if include_experts:
        rep = wb.evaluate(config, roles=EXPERTS, progress=lambda f, d: p(2 * f / steps, d), cancel=cancel)
        for role in EXPERTS:
            result.rows.append(_row(ROLE_NAMES[role], "expert", {"model": role}, rep, ROLE_NAMES[role]))
        step = 2
        if rep.cancelled:
            result.cancelled = True
            return result
    for pt in points:
        if cancel is not None and cancel.is_set():
            result.cancelled = True
            break
        sub(0.0, f"merging: {pt.name}")
        lw = wb.build(pt.recipe)
        rep = wb.evaluate(config, roles=("merged",), progress=lambda f, d, n=pt.name: sub(f, f"{n}: {d}"),
                          cancel=cancel)
        result.rows.append(_row(pt.name, "merge", pt.to_dict(), rep, ROLE_NAMES["merged"], lw))
        step += 1
        if rep.cancelled:
            result.cancelled = True
            break
    p(1.0, "cancelled" if result.cancelled else "done")
    return result


# ---- the resumable, file-backed runner -----------------------------------------------------------------

@dataclass
class Unit:
    """One record to produce: a model-level statistics row, an expert or a merge on one test set."""

    kind: str  # stats, expert, merge
    key: str
    identity: dict
    name: str
    point: SweepPoint | None = None
    role: str | None = None
    test: TestSet | None = None
    experts: dict = field(default_factory=dict)  # as the record shows them (`_experts_shown`)


@dataclass
class SweepRun:
    """What `run_sweep` did: the records of this sweep's points (in sweep order) and how it ended."""

    spec: SweepSpec
    path: Path | None
    rows: list[dict]
    cancelled: bool = False
    ran: int = 0  # points computed by this call (the rest were in the file already)
    left_out: dict[str, int] = field(default_factory=dict)  # expert set -> grid points that did not fit
    repaired: str | None = None  # the damaged last line this call cut off and redid


def _test_identity(t: TestSet) -> dict:
    if t.path is None:
        return {"path": None, "langs": list(t.langs)}
    files = sorted(f for f in Path(t.path).iterdir() if f.suffix in (".tsv", ".json"))
    return {"name": t.name, "fingerprint": content_hash((f.name, f.read_bytes()) for f in files),
            "langs": list(t.langs)}


def _experts_identity(cks: dict) -> dict:
    """What a record's key holds of its experts: their content (`Checkpoint.content_id`), not where they are, so
    a results file is reused from another clone or machine."""
    return {r: {"fingerprint": ck.content_id()} for r, ck in cks.items()}


def _experts_shown(cks: dict, identity: dict) -> dict:
    """The record's experts: the key's identity plus each model's portable reference (`presets.portable_ref`)."""
    return {r: {"ref": portable_ref(ck.ref), **identity[r]} for r, ck in cks.items()}


def _open_set(s: ExpertSet) -> dict:
    from .adapters import open_expert
    from .checkpoints import Checkpoint

    cks = {"math": open_expert(s.math, s.base), "lang": open_expert(s.lang, s.base)}
    if s.base:
        cks["base"] = Checkpoint.open(s.base)
    return cks


def _units(spec: SweepSpec, s: ExpertSet, cks: dict, left_out: dict) -> list[Unit]:
    experts = _experts_identity(cks)
    shown = _experts_shown(cks, experts)
    common = {"experts": experts, "force": s.force}
    engine = {k: spec.engine.get(k) for k in ("engine", "chat_template")}
    units: list[Unit] = []
    if spec.stats:
        ident = {**common, "stats": 1}
        units.append(Unit("stats", point_key(ident), ident, "model-level statistics", experts=shown))
    points, dropped = fit_points(spec.points, cks["math"].num_layers, str(spec.path or spec.name))
    if dropped:
        left_out[s.name] = dropped
    evals = spec.eval_settings()
    tests = [(t, _test_identity(t)) for t in spec.test_sets]
    for t, tid in tests:
        if spec.include_experts:
            for role in EXPERTS:
                ident = {**common, "model": role, "test": tid, "eval": evals, "engine": engine}
                units.append(Unit("expert", point_key(ident), ident, ROLE_NAMES[role], role=role, test=t,
                                  experts=shown))
    for pt in points:
        for t, tid in tests:
            ident = {**common, "recipe": pt.recipe.to_dict(), "test": tid, "eval": evals, "engine": engine}
            units.append(Unit("merge", point_key(ident), ident, pt.name, point=pt, test=t, experts=shown))
    return units


def _record(spec: SweepSpec, s: ExpertSet, u: Unit, **extra) -> dict:
    r = {"key": u.key, "sweep": spec.name, "set": s.name, "kind": u.kind, "name": u.name,
         "recipe": u.point.recipe.to_dict() if u.point else None, "vars": dict(u.point.vars) if u.point else {},
         "role": u.role, "experts": u.experts or u.identity["experts"], "force": s.force}
    if u.test is not None:
        r.update(test_set={"name": u.test.name, "path": u.test.path and portable_ref(u.test.path),
                           **u.identity["test"]},
                 eval={"langs": list(u.test.langs), **u.identity["eval"]}, engine=u.identity["engine"])
    r.update(extra)
    return r


def _scores(report: EvalReport, model: str) -> dict:
    langs = report.config.langs
    acc = {m: {lang: report.accuracy(model, lang, m) or 0.0 for lang in langs} for m in ("flexible", "strict")}
    correct = {lang: "".join("1" if q.flexible_correct else "0" for q in sorted(
        (q for q in report.results if q.model == model and q.lang == lang), key=lambda q: q.index)) for lang in langs}
    return {"accuracy": acc, "n": {lang: report.counts(model, lang) for lang in langs}, "correct_flexible": correct,
            "engine_used": report.engines.get(model, "")}


def _workbench(spec: SweepSpec):
    from .engines import VLLMSettings
    from .workbench import Workbench

    e = spec.engine
    return Workbench(device=e.get("device", "auto"), batch_size=int(e.get("batch_size", 8)), engine=e.get("engine"),
                     serving=e.get("serving", "auto"),
                     vllm=VLLMSettings(max_model_len=e.get("max_model_len"),
                                       tensor_parallel_size=int(e.get("tensor_parallel_size") or 1)),
                     chat_template=bool(e.get("chat_template", False)))


def _stats(wb) -> dict:
    """Each expert's distance from the base: sampled (the shared-base check) and over every weight."""
    out: dict = {"pairing": {"distances": wb.pairing.distances, "threshold": wb.pairing.threshold,
                             "suspicious": bool(wb.pairing.suspicious)}}
    if "base" in wb.checkpoints:
        summ = wb.analysis().summary()
        out["relative_change"] = {r: summ[f"relative_{r}"] for r in EXPERTS}
        out["cosine"] = summ["cosine"]
    return out


def refusal_reason(s: ExpertSet, cks: dict) -> str | None:
    """Why this expert set cannot be merged (the checks `Workbench.load` makes), or None."""
    from .checkpoints import check_compatible, check_pairing

    report = check_compatible(cks["math"], cks["lang"], cks.get("base"))
    if not report.ok:
        return report.summary().replace("\n", " | ")
    pairing = check_pairing(cks["math"], cks["lang"], cks.get("base"))
    if pairing.suspicious and not s.force:
        return pairing.message() + "."
    return None


def refused_record(spec: SweepSpec, s: ExpertSet, cks: dict, key: str, reason: str) -> dict:
    ident = _experts_identity(cks)
    return _record(spec, s, Unit("refused", key, {"experts": ident}, "refused", experts=_experts_shown(cks, ident)),
                   message=reason)


def execute(wb, spec: SweepSpec, s: ExpertSet, units: list[Unit], cancel: threading.Event | None = None,
            tell: Callable[[float, str], None] = no_progress):
    """Records for `units` of expert set `s`, with `wb` holding its experts; stops early when `cancel` is set."""
    built, lw = None, None
    for u in units:
        if cancel is not None and cancel.is_set():
            return
        t = time.perf_counter()
        if u.kind == "stats":
            tell(0.0, f"{s.name}: distances from the base")
            yield _record(spec, s, u, **_stats(wb), seconds=time.perf_counter() - t)
            continue
        extra = {}
        if u.kind == "merge":
            if built != u.point.name:
                tell(0.0, f"merging {u.name}")
                lw, built = wb.build(u.point.recipe), u.point.name
            plan = u.point.recipe.plan
            extra = {"layer_weights": lw, "reverted": sorted(plan.reverted()) if plan else [],
                     "pairing_forced": bool(wb.pairing.suspicious)}
        model = "merged" if u.kind == "merge" else u.role
        rep = wb.evaluate(u.test.config(spec.eval_settings()), roles=(model,),
                          progress=lambda f, d, n=u.name: tell(f, f"{n}: {d}"), cancel=cancel)
        if rep.cancelled:
            return
        yield _record(spec, s, u, **_scores(rep, ROLE_NAMES[model]), **extra, engine_note=wb.engine_note,
                      seconds=time.perf_counter() - t)


def _layout(spec: SweepSpec, left_out: dict) -> tuple[list, dict[str, str]]:
    """Per expert set: its checkpoints (headers only) and units; and the key of each set's refusal record."""
    plan = [(s, cks, _units(spec, s, cks, left_out)) for s in spec.expert_sets for cks in [_open_set(s)]]
    refusal = {s.name: point_key({"experts": _experts_identity(cks), "force": s.force, "refused": 1})
               for s, cks, _ in plan}
    return plan, refusal


def _ordered(plan: list, refusal: dict[str, str], rows: dict[str, dict]) -> list[dict]:
    """This sweep's records in sweep order, named as this sweep names its points (another sweep sharing the
    results file may have measured the same point under another name)."""
    out = []
    for s, _, units in plan:
        if refusal[s.name] in rows:
            out.append(rows[refusal[s.name]])
        for u in units:
            if u.key in rows:
                out.append({**rows[u.key], "name": u.name, "set": s.name,
                            "vars": dict(u.point.vars) if u.point else {}})
    return out


def sweep_results(spec: SweepSpec | str | Path, out: str | Path) -> list[dict]:
    """The records a results file holds for this sweep's points, in sweep order (nothing is run or loaded
    beyond checkpoint headers); several sweeps may share one results file."""
    spec = spec if isinstance(spec, SweepSpec) else load_spec(spec)
    spec.check_experts()
    plan, refusal = _layout(spec, {})
    return _ordered(plan, refusal, {r["key"]: r for r in load_results(out)})


def run_sweep(spec: SweepSpec | str | Path, out: str | Path | None, progress: Progress | None = None,
              cancel: threading.Event | None = None, *, workbench: Callable[[SweepSpec], object] | None = None,
              ) -> SweepRun:
    """Run (or resume) a sweep, appending each finished point to the results file `out` (None: a
    temporary file, removed afterwards). `progress(fraction, text)` hears about every step, with the
    count of points and an ETA; `cancel` stops after the current batch (what is finished is kept)."""
    spec = spec if isinstance(spec, SweepSpec) else load_spec(spec)
    spec.check_experts()
    p = progress or no_progress
    tmp = Path(tempfile.mkdtemp(prefix="layerswap-sweep-")) if out is None else None
    path = Path(out) if out is not None else tmp / "results.jsonl"
    make = workbench or _workbench
    left_out: dict[str, int] = {}
    try:
        with ResultsLog(path) as log:
            plan, refusal = _layout(spec, left_out)
            total = sum(len(us) for _, _, us in plan)
            done = sum(len(us) if refusal[s.name] in log else sum(u.key in log for u in us) for s, _, us in plan)
            ran, t0, cancelled = 0, time.perf_counter(), False

            def tell(f: float, what: str) -> None:
                eta = ""
                if ran:
                    rate = (time.perf_counter() - t0) / ran
                    eta = f" · ETA {_clock(rate * (total - done - f))}"
                p(min(1.0, (done + f) / max(total, 1)), f"{done}/{total}{eta} · {what}")

            for s, cks, units in plan:
                todo = [u for u in units if u.key not in log]
                if not todo or cancelled or refusal[s.name] in log:
                    continue
                reason = refusal_reason(s, cks)
                if reason:  # different shapes, or a different base without force
                    log.append(refused_record(spec, s, cks, refusal[s.name], reason))
                    done += len(todo)
                    continue
                wb = make(spec)
                try:
                    tell(0.0, f"{s.name}: loading the experts")
                    wb.load(s.math, s.lang, s.base, force=s.force)
                    for rec in execute(wb, spec, s, todo, cancel, tell):
                        log.append(rec)
                        done += 1
                        ran += 1
                    cancelled = cancel is not None and cancel.is_set()
                finally:
                    wb.close()
            rows = _ordered(plan, refusal, log.rows)
            p(1.0, "cancelled" if cancelled else "done")
            return SweepRun(spec, None if tmp else path, rows, cancelled, ran, left_out, log.repaired)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


__all__ = ["SweepPoint", "SweepRun", "ablation_suite", "evaluate_points", "load_results", "run_sweep", "swap_grid",
           "sweep_results"]
