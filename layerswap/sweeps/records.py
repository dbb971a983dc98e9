"""The records of a sweep's results file: what each one measures (its identity and key), how a sweep's
points become units of work, and the record written for each (a merge, an expert, statistics, a refusal,
an lm-eval run). `run` and `ray` write them; `report` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from layerswap.models.cache import content_hash
from layerswap.evaluation import mgsm
from layerswap.evaluation.run import EvalReport
from layerswap.models.presets import portable_ref
from layerswap.core.roles import EXPERTS, ROLE_NAMES
from layerswap.sweeps.log import point_key
from layerswap.sweeps.spec import ExpertSet, SweepPoint, SweepSpec, TestSet, fit_points


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
    experts: dict = field(default_factory=dict)  # as the record shows them (`experts_shown`)


def identity_of_test_set(t: TestSet) -> dict:
    if t.path is None:
        return {"path": None, "langs": list(t.langs)}
    files = sorted(f for f in mgsm.folder(t.path).iterdir() if f.suffix in (".tsv", ".json"))  # or assets:
    return {"name": t.name, "fingerprint": content_hash((f.name, f.read_bytes()) for f in files),
            "langs": list(t.langs)}


def experts_identity(cks: dict) -> dict:
    """What a record's key holds of its experts: their content (`Checkpoint.content_id`), not where they are, so
    a results file is reused from another clone or machine."""
    return {r: {"fingerprint": ck.content_id()} for r, ck in cks.items()}


def experts_shown(cks: dict, identity: dict) -> dict:
    """The record's experts: the key's identity plus each model's portable reference (`presets.portable_ref`)."""
    return {r: {"ref": portable_ref(ck.ref), **identity[r]} for r, ck in cks.items()}


def open_set(s: ExpertSet) -> dict:
    from layerswap.models.adapters import open_expert
    from layerswap.models.checkpoints import Checkpoint

    cks = {"math": open_expert(s.math, s.base), "lang": open_expert(s.lang, s.base)}
    if s.base:
        cks["base"] = Checkpoint.open(s.base)
    return cks


def units_of(spec: SweepSpec, s: ExpertSet, cks: dict, left_out: dict) -> list[Unit]:
    experts = experts_identity(cks)
    shown = experts_shown(cks, experts)
    common = {"experts": experts, "force": s.force}
    engine = {k: spec.engine.get(k) for k in ("engine", "chat_template")}
    units: list[Unit] = []
    if spec.stats:
        ident = {**common, "stats": 1}
        units.append(Unit("stats", point_key(ident), ident, "model-level statistics", experts=shown))
    points, dropped = fit_points(spec.points_for(s), cks["math"].num_layers, str(spec.path or spec.name))
    if dropped:
        left_out[s.name] = dropped
    evals = spec.eval_settings()
    tests = [(t, identity_of_test_set(t)) for t in s.scored_on(spec.test_sets)]
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


NOT_RUN = "not run"  # a merge point its experts cannot take (the record's message says why)


def record(spec: SweepSpec, s: ExpertSet, u: Unit, **extra) -> dict:
    r = {"key": u.key, "sweep": spec.name, "set": s.name, "kind": u.kind, "name": u.name,
         "recipe": u.point.recipe.to_dict() if u.point else None, "vars": dict(u.point.vars) if u.point else {},
         "role": u.role, "experts": u.experts or u.identity["experts"], "force": s.force, **_family(s)}
    if u.test is not None:
        r.update(test_set={"name": u.test.name, "path": u.test.path and portable_ref(u.test.path),
                           **u.identity["test"]},
                 eval={"langs": list(u.test.langs), **u.identity["eval"]}, engine=u.identity["engine"])
    r.update(extra)
    return r


def _family(s: ExpertSet) -> dict:
    """A family member's records name its family (`report.family_table` lays them out as the paper's table)."""
    return {"family": s.family} if s.family else {}


def evaluation_fields(report: EvalReport, model: str) -> dict:
    """A record's fields for `model`'s evaluation: accuracy and counts per language, which questions it got right."""
    langs = report.config.langs
    acc = {m: {lang: report.accuracy(model, lang, m) or 0.0 for lang in langs} for m in mgsm.TASK.metric_names}
    correct = {lang: "".join("1" if q.flexible_correct else "0" for q in sorted(
        (q for q in report.results if q.model == model and q.lang == lang), key=lambda q: q.index)) for lang in langs}
    return {"accuracy": acc, "n": {lang: report.counts(model, lang) for lang in langs}, "correct_flexible": correct,
            "engine_used": report.engines.get(model, "")}


def refusal_reason(s: ExpertSet, cks: dict) -> str | None:
    """Why this expert set cannot be merged (`checkpoints.check_mergeable`, as `Workbench.load` checks), or None."""
    from layerswap.models.pairing import check_mergeable

    return check_mergeable(cks["math"], cks["lang"], cks.get("base"), force=s.force).problem()


def refused_record(spec: SweepSpec, s: ExpertSet, cks: dict, key: str, reason: str) -> dict:
    ident = experts_identity(cks)
    return record(spec, s, Unit("refused", key, {"experts": ident}, "refused", experts=experts_shown(cks, ident)),
                  message=reason)


def layout(spec: SweepSpec, left_out: dict) -> tuple[list, dict[str, str]]:
    """Per expert set: its checkpoints (headers only) and units; and the key of each set's refusal record."""
    plan = [(s, cks, units_of(spec, s, cks, left_out)) for s in spec.expert_sets for cks in [open_set(s)]]
    refusal = {s.name: point_key({"experts": experts_identity(cks), "force": s.force, "refused": 1})
               for s, cks, _ in plan}
    return plan, refusal


def ordered(plan: list, refusal: dict[str, str], rows: dict[str, dict]) -> list[dict]:
    """This sweep's records in sweep order, named as this sweep names its points (another sweep sharing the
    results file may have measured the same point under another name)."""
    out = []
    for s, _, units in plan:
        if refusal[s.name] in rows:
            out.append(rows[refusal[s.name]])
        for u in units:
            if u.key in rows:
                out.append({**rows[u.key], "name": u.name, "set": s.name,
                            "vars": dict(u.point.vars) if u.point else {}, **_family(s)})
    return out


def lm_eval_record(experts: dict, recipe: dict | None, name: str, settings: dict, metrics: dict,
                   force: bool = False, set_name: str = "") -> dict:
    """A results-file record (kind ``lm-eval``) of lm-evaluation-harness `metrics` ({task: {metric: value}},
    `layerswap.sweeps.lmeval`) for a merge (`recipe`) or a model (`recipe` None); `settings`: what changes the
    numbers (`LmEvalConfig.settings`); `experts` as `experts_shown` gives them (only their fingerprints key it);
    `set_name`: the expert set it belongs to (`spec.set_name`)."""
    ident = {"experts": {r: {"fingerprint": e["fingerprint"]} for r, e in experts.items()}, "force": force,
             "recipe": recipe, "lm_eval": settings}  # where the models are is not part of the key
    return {"key": point_key(ident), "sweep": "lm-eval", "set": set_name, "kind": "lm-eval", "name": name,
            "recipe": recipe, "experts": experts, "force": force, "lm_eval": settings,
            "metrics": {f"{task} {m}": v for task, ms in metrics.items() for m, v in ms.items()}}
