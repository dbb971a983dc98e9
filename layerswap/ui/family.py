"""The page's expert family: one math expert and N language experts (each with its MGSM code), evaluated together.

In the Models section a text area takes the language experts as ``CODE=REF`` lines (`models.family.Family.parse`:
each code once, at most the server's cap, `hosting.Policy.family_cap`); Load family checks the whole family once
(`serving.family.preflight`: the codes' test sets, every member against the math expert and the base) and keeps it
on the visitor, so the pair above (Load) and everything built so far stay as they were; a refusal is one dialog
and keeps the family loaded before it. Empty, the page is the single-pair page it always was. A preset that names
a family (its ``langs:``) fills the lines (`preset_lines`).

The Evaluate tab's family section builds and evaluates it (`serving.family.evaluate_family`): per language the math
expert, that language's expert and each chosen merge, each merge built in memory in turn, one pair loaded at a time.
The swap is the page's plan, shared by every language unless a ``CODE=b,u,tb,tu`` line gives one its own
(`own_plans`); the baselines take the page's method values (`PlanControls.variant`). The table
(`evaluation.table.family_table`, Markdown) and its plot (`plots.family_bars`) fill in as each model's answers of a
language are in; Stop ends it after its batch, keeping what is done; at the end the table downloads as JSON (as
``layerswap eval --json``). The share link carries the family's lines (`specs`), read back bounded (`restore`).
Its heatmaps per language and its export are `ui.family_views`'.
"""

from __future__ import annotations

import contextvars
import queue
import threading
import time
from dataclasses import dataclass

import gradio as gr

from layerswap.core.errors import UserError
from layerswap.core.markup import code, text
from layerswap.models.family import MAX_LANGS, Family, FamilyCheck
from layerswap.recipe.methods import FAMILY_METHODS, method_list
from layerswap.ui.context import Context, Page
from layerswap.ui.controls import MAX_TEXT, PlanControls, lines_of, own_plans, plan_specs
from layerswap.ui.events import Job

METHODS = [("swap (the page's plan)", "swap"), ("soup", "soup"), ("task arithmetic", "ta"), ("TIES", "ties")]


@dataclass(frozen=True)
class Loaded:
    """A visitor's checked family: the members, the test set they are scored on, and what the check found."""

    family: Family
    source: str | None
    check: FamilyCheck
    force: bool = False  # loaded with Force: its members load again the same way


def parse(ctx: Context, math: str, base: str, value: object) -> Family | None:
    """The family the fields say (every reference through the hosting rules), or None when no line is given."""
    cap = ctx.policy.family_cap
    lines = lines_of(value, cap)
    if not lines:
        return None
    fam = Family.parse(ctx.policy.check_ref(math, "math expert"), lines, ctx.policy.check_ref(base, "base") or None,
                       cap=cap)
    for m in fam.members:
        ctx.policy.check_ref(m.ref, f"{m.code} expert")
    return fam


def load_family(ctx: Context, job: Job, base: str, math: str, family: str, force: bool = False) -> str:
    """Check the family once (headers and a few MB of each member) and keep it for the visitor; no line: no family."""
    v = job.visitor
    fam = parse(ctx, math, base, family)
    if fam is None:
        v.family = None
        return "No family: the page evaluates the pair above. Write CODE=REF lines to add language experts."
    t0 = time.perf_counter()
    for m in fam.members:  # hosted mode: Hub models through the size checks first
        ctx.fetch((fam.base or "", fam.math, m.ref), job)
    source = ctx.data((fam.base or "", fam.math, fam.members[0].ref))
    from layerswap.serving.family import preflight

    job.progress(0.5, "checking the family")
    with ctx.shared.lock:
        check = preflight(fam, source, cap=ctx.policy.family_cap, force=bool(force))
    v.family = Loaded(fam, source, check, bool(force))
    rows = "".join(f"\n- **{m.code}**: {code(m.ref)} ({text(check.lines[m.code])})" for m in fam.members)
    return (f"**Family loaded:** math expert {code(fam.math)}, {len(fam.members)} language experts, "
            f"{check.num_layers} layers, checked in {time.perf_counter() - t0:.1f} s:{rows}\n\n"
            "Evaluate its table in the Evaluate tab.")


def preset_lines(ctx: Context, job: Job, name: str):
    """A preset that names a family (its ``langs:``, code -> language expert) fills the text area; others leave it."""
    langs = getattr(ctx.presets.get(name) if isinstance(name, str) else None, "langs", ()) or ()
    return gr.update(value="\n".join(f"{c}={r}" for c, r in langs)) if langs else gr.update()


def specs(v) -> list[str]:
    """The visitor's family as the share link writes it (its ``CODE=REF`` lines)."""
    return [m.spec for m in v.family.family.members] if getattr(v, "family", None) is not None else []


def restore(ctx: Context, params: dict) -> list:
    """The text areas from a link's ``family`` and ``family_plans`` values, each read back bounded (size, lines,
    codes, references; the plans' numbers by their fields); a value refused is ignored (the visitor loads the
    family with Load family)."""
    plans = plan_specs(params.get("family_plans"))
    out = [gr.update(), gr.update(value=plans) if plans else gr.update()]
    try:
        cap = ctx.policy.family_cap
        lines = lines_of(params.get("family"), cap)
        if lines:
            for m in Family.parse("(the link's math expert)", lines, cap=cap).members:
                ctx.policy.check_ref(m.ref, f"{m.code} expert")
            out[0] = gr.update(value="\n".join(lines))
    except UserError:
        pass
    return out


def recipes(fam: Family, methods: list[str], controls: PlanControls, own: dict[str, dict[str, str]]) -> dict:
    """Per code, label -> recipe: the swap is the page's plan (shared) unless the language has its own `own`
    b,u,tb,tu (the rest of the page's plan kept); the baselines take the page's method values."""
    shared = {}
    for label, name in method_list(",".join(methods)):
        if name == "layer_swap" and controls.recipe.method.name != "layer_swap":
            raise UserError(f"The page's plan is a {controls.recipe.method.name} merge; the family's swap row takes "
                            "a layer swap: choose layer swapping in Build, or untick swap.")
        shared[label] = controls.recipe if name == "layer_swap" else controls.variant(method=name)
    out = {}
    for c in fam.codes:
        out[c] = {label: controls.for_language(own, c) if r.method.name == "layer_swap" else r
                  for label, r in shared.items()}
    return out


def evaluate_family(ctx: Context, job: Job, methods, plans, limit, shots, mode, max_new, controls: PlanControls):
    """The family's table and plot, filled in as each model's answers of a language are in."""
    from layerswap.analysis.plots import family_bars
    from layerswap.core.errors import whole_number
    from layerswap.evaluation import mgsm
    from layerswap.evaluation.run import EvalConfig
    from layerswap.evaluation.table import family_table
    from layerswap.serving.family import check_recipes, evaluate_family as run

    v = job.visitor
    loaded: Loaded | None = v.family
    if loaded is None:
        raise UserError("Load a family first: under Models write one CODE=REF line per language expert, then press "
                        "Load family.")
    fam = loaded.family
    given = methods if isinstance(methods, (list, tuple)) else []
    picked = [m for _, m in METHODS if m in given]
    if not picked:
        raise UserError("Choose at least one merge for the family's table.")
    limit = whole_number(limit or 0, "Questions per language", 0, 10**6)
    cfg = EvalConfig(langs=list(fam.codes), limit=limit or None, shots=whole_number(shots, "Few-shot exemplars", 0, 8),
                     mode=mode, max_new_tokens=ctx.policy.new_tokens(max_new), source=loaded.source)
    cfg.validate()
    largest = max(len(mgsm.load(c, loaded.source)) for c in fam.codes) if ctx.policy.hosted and not cfg.limit else 0
    ctx.policy.check_eval(cfg.limit, largest)
    own = own_plans(fam, plans)
    rs = recipes(fam, picked, controls, own)
    check_recipes(fam, rs, loaded.check.num_layers, have_base=bool(fam.base))
    updates: queue.Queue = queue.Queue()
    done: dict = {}
    notes: list[str] = []  # the first: the family plan's outcome that runs, and why
    shared = [c for c in fam.codes if c not in own]
    swap = "".join(f" · {', '.join(cs)}: {text(rs[cs[0]]['swap'].title())}" for cs in
                   [shared, *[[c] for c in fam.codes if c in own]] if cs) if "swap" in picked else ""

    def work() -> None:
        try:
            with ctx.shared.lock:  # the one lane: nothing else loads models meanwhile
                done["report"] = run(fam, rs, cfg, ctx.d.engine, force=loaded.force, cancel=v.stop,
                                     progress=lambda f, d: job.bar(f, desc=d + job.time_left(f)),
                                     on_model=lambda r: updates.put(snapshot(r)), note=notes.append)
        except BaseException as e:  # said by the event (a dialog), after what was shown
            done["error"] = e
        finally:
            updates.put(None)

    def snapshot(report) -> tuple:  # what is in now (the report grows in the worker meanwhile)
        return family_table(report), len(report.results)

    def shown(now: tuple, state: str):
        table, answers = now
        title = f"MGSM {cfg.mode}, {cfg.shots}-shot: the family's table" + (" (partial)" if state else "")
        status = f"{state or '**Done:**'} {answers} answers in {time.perf_counter() - t0:.0f} s{swap}" + \
            (f"\n\nEngines: {text(notes[0])}" if notes else "")
        return (status, gr.update(value=table.markdown(), visible=True),
                gr.update(value=family_bars(table, title=title), visible=True), gr.update())

    t0 = time.perf_counter()
    context = contextvars.copy_context()  # the event's own (Gradio's progress bar reads it)
    worker = threading.Thread(target=context.run, args=(work,), name="layerswap-family", daemon=True)
    worker.start()
    try:
        yield "Loading the first language's experts…", gr.update(), gr.update(), gr.update()
        while (item := updates.get()) is not None:  # one per model and language: at most 8 × 10
            yield shown(item, "**Evaluating…**")
        worker.join()
    finally:
        if worker.is_alive():  # the event ended early (its caller went away): the evaluation stops after its batch
            v.stop.set()
    if "error" in done:
        raise done["error"]
    report = done["report"]
    final = shown(snapshot(report), "**Cancelled:**" if report.cancelled else "")
    from layerswap.models.presets import portable_ref

    extra = {"protocol": {"mode": cfg.mode, "shots": cfg.shots, "max_new_tokens": cfg.max_new_tokens,
                          "limit": cfg.limit},
             "family": {"math": portable_ref(fam.math), "base": fam.base and portable_ref(fam.base),
                        "languages": {m.code: portable_ref(m.ref) for m in fam.members}},
             "recipes": {c: {label: r.to_dict() for label, r in by.items()} for c, by in rs.items()}}
    path = family_table(report).write(ctx.shared.folder(v) / "family_table.json", "json", extra)  # as eval --json
    yield (*final[:3], gr.update(value=str(path), visible=True))


def render_models(ctx: Context, page: Page) -> dict:
    """The family's text area, its Load button and its report (inside the Models section)."""
    src = "Hub id" if ctx.policy.hosted else "folder or Hub id"
    with gr.Row():
        page.family = gr.Textbox("", lines=2, max_lines=MAX_LANGS, max_length=MAX_TEXT, elem_id="family", scale=4,
                                 label=f"Language family (optional): one CODE=REF line per language expert, up to "
                                       f"{ctx.policy.family_cap} (MGSM code = {src}), e.g. sw=org/swahili-expert")
        load_btn = gr.Button("Load family", variant="primary", elem_id="family-load", scale=1)
        page.family_plans = gr.Textbox("", lines=1, max_lines=MAX_LANGS, max_length=MAX_TEXT, scale=2,
                                       elem_id="family-plans", label="Per-language swap plans (optional): "
                                       "CODE=b,u,tb,tu lines; the others take the page's plan")
    report = gr.Markdown("", elem_id="family-report")
    strip = gr.Plot(label="Layer sources per language", visible=False, elem_id="family-strip")
    strip_note = gr.Markdown("", elem_id="family-strip-note")
    return dict(load=load_btn, report=report, strip=strip, strip_note=strip_note)


def render_eval(ctx: Context, page: Page, limit, shots, mode, max_new) -> dict:
    """The family section of the Evaluate tab (its questions per language and protocol are the tab's); the tab
    wires its Stop."""
    gr.Markdown("#### The family's table: per language, both experts and each merge (load a family under Models)")
    with gr.Row():
        methods = gr.CheckboxGroup(METHODS, value=FAMILY_METHODS.split(","), label="Merges per language",
                                   elem_id="family-methods", scale=3)
        run_btn = gr.Button("Build and evaluate the family", variant="primary", elem_id="family-run", scale=1)
        stop_btn = gr.Button("Stop", variant="stop", elem_id="family-stop", scale=1)
    status = gr.Markdown("Load a family, then evaluate it: the table fills in as each model finishes.",
                         elem_id="family-status")
    table = gr.Markdown(visible=False, elem_id="family-table")
    bars = gr.Plot(label="Accuracy per language with exact 95% intervals", elem_id="family-bars", visible=False)
    saved = gr.File(label="The table (JSON: per language and model n, accuracy, interval, p; as layerswap eval --json)",
                    visible=False, elem_id="family-file")
    run_btn.click(ctx.job(evaluate_family, plan=True, models=True),
                  [methods, page.family_plans, limit, shots, mode, max_new, *page.plan, page.models],
                  [status, table, bars, saved],
                  api_name="evaluate_family", **ctx.lane, show_progress_on=[status])
    return dict(stop=stop_btn, status=status)


def wire(ctx: Context, page: Page, parts: dict):
    """Load family: checked in the lane, then the share link carries it (the event is returned). A family's preset
    fills the lines."""
    parts["preset"].input(ctx.job(preset_lines, clear_stop=False), [parts["preset"]], [page.family],
                          api_visibility="private", queue=False)
    dep = parts["load"].click(ctx.job(load_family), [*page.refs[:2], page.family, parts["force"]], [parts["report"]],
                              api_name="load_family", **ctx.lane, **page.on)
    dep.success(**page.link)
    return dep
