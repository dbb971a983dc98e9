"""The Models section above the tabs: presets, the three model fields, Load, Stop, and the page's opening.

Opening the page restores a shared link's models, plan and tab (`controls.restore`; without a tab in the link the
visitor stays where they are) and its family's lines (`ui.family.restore`). What can be shown comes at once, off
the queue and without waiting for the models (`glance`: status, share link, plan controls, what belongs to the
models); the models' report and the plan's strip follow once their headers are read (`first_view`). Load (or
picking a preset of complete models) loads them and sets everything that belongs to them: the plan they open on
(`organisms.opening_plan`), their MGSM set with its menus, the banner and card, the test-set line
(`Page.on_models`). Both end by redrawing the analysis. The share link is recomputed from the current values on
every change of the plan and of the open tab (`share_link`), and after Load family. The family's own controls
are `ui.family`'s.
"""

from __future__ import annotations

import functools
import time

import gradio as gr

from layerswap.core.errors import UserError
from layerswap.recipe.fields import FIELDS
from layerswap.core.markup import text
from layerswap.shipped.organisms import opening_plan, preset_of
from layerswap.ui import family, family_views
from layerswap.ui.context import Context, Page
from layerswap.ui.controls import TABS, PlanControls, plan_specs, plan_values, query_string, restore
from layerswap.ui.events import Job, page_models


def pick_preset(ctx: Context, job: Job, name: str):
    p = ctx.presets.get(name)
    if p is None:
        return [gr.update()] * 4
    note = p.note + ("" if p.lang else " **Type a language expert** fine-tuned from this base, then Load.")
    return [gr.update(value=p.base), gr.update(value=p.math), gr.update(value=p.lang), note]


def load(ctx: Context, job: Job, base: str, math: str, lang: str, force: bool = False):
    refs = (ctx.policy.check_ref(base, "base"), ctx.policy.check_ref(math, "math expert"),
            ctx.policy.check_ref(lang, "language expert"))
    t0 = time.perf_counter()
    ctx.fetch(refs, job)
    ctx.shared.wait_ready(lambda f, d: job.progress(0, d))
    try:
        wb = ctx.shared.workbench(refs, bool(force), job.part(0.5, 1.0))
    except UserError as e:
        raise UserError(f"The models cannot be loaded: {e}") from None
    job.visitor.refs, job.visitor.force = refs, bool(force)
    report = ctx.models_md(wb) + f"\n\nLoaded in {time.perf_counter() - t0:.1f} s."
    L = wb.num_layers
    p = opening_plan(refs, L).plan  # a shipped pair's recommended plan, else the literature's
    return [report] + [gr.update(maximum=L, value=x) for x in (p.b, p.u, p.tb, p.tu)]


def load_preset(ctx: Context, job: Job, base: str, math: str, lang: str):
    """A preset picked: its models loaded, unless it leaves the language expert to the visitor (then the events
    after it do not run either)."""
    if not (math and lang):
        raise gr.Error("Type a language expert, then Load.", visible=False)
    return load(ctx, job, base, math, lang)


KEEP = ("k", "seed", "offset")  # the other maps' parameters: a Load leaves them as the visitor set them


def opening(ctx: Context, job: Job):
    """After a Load: the plan controls on the plan the models open on (layer swapping: map, transition, revert)."""
    wb = ctx.shared.loaded(job.visitor.refs)
    if wb is None:
        return [gr.update()] * len(FIELDS)
    updates = plan_values(opening_plan(job.visitor.refs, wb.num_layers).plan)
    return [gr.update() if f.name in KEEP else u for f, u in zip(FIELDS, updates)]


STOP_WAIT = 20.0  # seconds Stop waits for the job to end before saying it is still stopping


def stop(ctx: Context, job: Job) -> str:
    """Stop the visitor's job (between its batches) and say what happened: nothing ran, it stopped, or it stops
    after its current step. The line never says "stopping" once no job of the visitor's runs."""
    v = job.visitor
    asked = v.stop.is_set()  # a Stop already waits for this job: this one answers at once (no thread held)
    v.stop.set()  # a job that starts later clears it
    if v.job is None:  # no job of the visitor's queued or running (`ui.lane`)
        return "Nothing of yours is running: nothing to stop."
    if asked:
        return "**Stopping** your job: it stops after its current step."
    deadline = time.monotonic() + STOP_WAIT
    while v.job is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    if v.job is None:
        return "**Stopped** your job (what it finished is kept)."
    return "**Stopping** your job: it stops after its current step."


def held(ctx: Context, job: Job) -> str:
    """The models the server holds for the visitor, for the page to send back (after Load)."""
    return page_models(job.visitor.refs)


def open_page(ctx: Context, job: Job):
    """Page open: this tab's plan, tab and models restored from the URL if it has them; the open tab only moves
    when the link names one."""
    v = job.visitor
    params = dict(job.request.query_params) if job.request is not None else {}
    try:
        refs = tuple(ctx.policy.check_ref(params.get(k, "")) for k in ("base", "math", "lang"))
    except UserError:  # a link naming models this server does not open: the defaults stay
        refs = ("", "", "")
    if refs[1] and refs[2]:
        v.refs = refs  # loaded by the view that follows
    updates, tab = restore(params)
    status = ctx.shared.status if not ctx.shared.ready.is_set() else "Models ready."
    moved = [gr.Tabs(selected=tab), tab] if tab else [gr.update(), gr.update()]
    return [status, *[gr.update(value=r) for r in v.refs], *updates, *moved, page_models(v.refs),
            *family.restore(ctx, params)]


def glance(ctx: Context, page: Page, job: Job, tab: str, plans, controls: PlanControls, with_views: bool) -> list:
    """What can be shown at once for the visitor's models, never waiting for them: the report and strip if they
    are loaded (else what the loading is doing), the share link, and (`with_views`, for models other than the
    page was laid out for) what belongs to the models (`views`)."""
    v = job.visitor
    wb = ctx.shared.loaded(v.refs)
    if wb is None or "math" not in wb.checkpoints:
        status = ctx.shared.status if not ctx.shared.ready.is_set() else "Loading the models…"
        shown = [f"*{text(status)}*", gr.update(), "*The plan is drawn once the models' headers are read.*",
                 *[gr.update()] * 4]
    else:
        try:
            built = wb.holds(controls.recipe)
            strip, md = ctx.strip_and_md(wb, controls, built=built)
        except UserError as e:
            strip, md = None, f"**Invalid plan:** {e}"
        shown = [ctx.models_md(wb), strip, md, *[gr.update(maximum=wb.num_layers)] * 4]
    rest = views(ctx, page, v.refs) if with_views and v.refs != ctx.key else [gr.update()] * len(page.view_outputs)
    return [*shown, share_link(ctx, job, tab, plans, controls), *rest]


def views(ctx: Context, page: Page, refs: tuple[str, str, str]) -> list:
    """Every component that belongs to the models (language menus, banner, test set...), for `refs`."""
    return [u for _, fn in page.views for u in fn(ctx, refs)]


def first_view(ctx: Context, job: Job, controls: PlanControls):
    """After the page opened: the models' report and the plan's strip once their headers are read (waits for the
    models, beside the lane; no engine needed, the plan is built when answers are asked for)."""
    wb = ctx.workbench(job)
    sliders = [gr.update(maximum=wb.num_layers)] * 4
    built = wb.holds(controls.recipe)
    return [ctx.models_md(wb), *ctx.strip_and_md(wb, controls, built=built), *sliders]


def share_link(ctx: Context, job: Job, tab: str, plans, controls: PlanControls) -> str:
    """The share link of the current values: the visitor's models and family (with its per-language plans), every
    plan control, the open tab."""
    return query_string(job.visitor.refs, controls.values, tab if tab in TABS else "build",
                        family.specs(job.visitor), plan_specs(plans))


def unloading(request: gr.Request, session: str) -> bool:
    """Is `request` Gradio's unload of `session` (it comes from the session's heartbeat route)?"""
    url = getattr(request, "url", None)
    return getattr(url, "path", "").endswith(f"/heartbeat/{session}")


def engine_line(ctx: Context, job: Job) -> str:
    """The engine line, read every few seconds: the visitor's models' engines as they run now
    (`Shared.engine_status`: derived from the engines, never from a start-up message)."""
    wb = ctx.shared.loaded(job.visitor.refs)
    now = ctx.shared.engine_status(wb) if wb is not None else ""
    return f"**Engine now:** {text(now)}" if now else ""  # may quote an engine's error


def render(ctx: Context, page: Page) -> dict:
    """The section's components; `wire` connects them once the tabs exist."""
    d, pol = ctx.d, ctx.policy
    with gr.Group():
        gr.Markdown("### 1 · Models")
        with gr.Row():
            preset = gr.Dropdown([(p.label, k) for k, p in ctx.presets.items()], value=preset_of(ctx.key),
                                 label="Presets", elem_id="preset", scale=3)
            preset_md = gr.Markdown(elem_id="preset-note")
        src = "Hub id" if pol.hosted else "folder or Hub id"
        with gr.Row():
            page.refs = [gr.Textbox(d.base, label="Base model (optional; needed for heatmaps)", elem_id="base"),
                         gr.Textbox(d.math, label=f"Math expert ({src})", elem_id="math"),
                         gr.Textbox(d.lang, label=f"Language expert ({src})", elem_id="lang")]
        with gr.Row():
            force = gr.Checkbox(False, label="Force: load even if the experts seem not to share the base", scale=3)
            load_btn = gr.Button("Load", variant="primary", elem_id="load", scale=1)
            stop_btn = gr.Button("Stop my job", variant="stop", elem_id="stop", scale=1)
        fam = family.render_models(ctx, page)
        page.report = gr.Markdown("Loading the default models…", elem_id="report")
        page.models = gr.Textbox("", visible=False, elem_id="page-models")  # set when the page opens and on Load
        engine_now = gr.Markdown(elem_id="engine-now")
        test_set = gr.Markdown(ctx.test_set_md(ctx.key), elem_id="test-set")
    page.on_models([preset, test_set], lambda c, refs: [gr.update(value=preset_of(refs)), c.test_set_md(refs)])
    return dict(preset=preset, preset_md=preset_md, force=force, load_btn=load_btn, stop_btn=stop_btn,
                engine_now=engine_now, ticks=gr.Timer(3), family=fam)


def wire(ctx: Context, page: Page, demo: gr.Blocks, c: dict) -> None:
    quick = dict(clear_stop=False)
    off = dict(queue=False, api_visibility="private")
    page.view_outputs = [o for outs, _ in page.views for o in outs]
    shown = [page.report, page.strip, page.plan_md, *page.sliders]
    at_once = [*shown, page.share, *page.view_outputs]
    linked = [page.tab, page.family_plans, *page.plan]  # what the share link carries besides the models

    def opened_view(ctx: Context, job: Job, tab: str, plans, controls: PlanControls):
        """The page's first view, at once (off the queue, nothing waited for)."""
        return glance(ctx, page, job, tab, plans, controls, with_views=True)

    def loaded_view(ctx: Context, job: Job, tab: str, plans, controls: PlanControls):
        """After a Load: the same (the Load itself set what belongs to the new models)."""
        return glance(ctx, page, job, tab, plans, controls, with_views=False)

    def with_views(fn):
        """`fn` (a Load), also setting what belongs to the new models in the same event: an API caller's next Ask
        or Evaluate is checked against this session's menus, and runs no event chained after Load. It keeps `fn`'s
        name (its time limit, `hosting.JOB_SECONDS`) and parameters (the API's argument names)."""
        @functools.wraps(fn)
        def loaded(ctx: Context, job: Job, *args):
            return [*fn(ctx, job, *args), *views(ctx, page, job.visitor.refs)]
        return loaded

    def after_load(dep) -> None:
        dep = dep.success(ctx.job(held, **quick), None, [page.models], **off)
        dep = dep.success(ctx.job(opening, **quick), None, page.plan, **off)
        page.redraw(dep.success(ctx.job(loaded_view, **quick, plan=True), linked, at_once, **off))

    opened = demo.load(ctx.job(open_page, **quick), None, [page.status, *page.refs, *page.plan, page.tabs, page.tab,
                                                           page.models, page.family, page.family_plans], **off)
    opened = opened.then(ctx.job(opened_view, **quick, plan=True), linked, at_once, **off)
    page.redraw(opened.then(ctx.job(first_view, plan=True, models=True), [*page.plan, page.models], shown,
                            api_visibility="private", **ctx.views, **page.on)).then(
        lambda: "Models ready.", None, [page.status], **off)

    def end(request: gr.Request) -> None:
        """The tab was closed: its visitor and files go. Only Gradio's own unload (the session's heartbeat
        ending) may call it; a caller reaching it through the queue is refused."""
        session = getattr(request, "session_hash", None)
        if not session or not unloading(request, session):
            raise gr.Error("Not an event of this page.")
        ctx.shared.end(session)

    demo.unload(end)
    picked = c["preset"].input(ctx.job(pick_preset, **quick), [c["preset"]], [*page.refs, c["preset_md"]],
                               api_name="preset", queue=False)
    loaded = [page.report, *page.sliders, *page.view_outputs]
    after_load(picked.success(ctx.job(with_views(load_preset)), page.refs, loaded, api_visibility="private", **ctx.lane,
                              **page.on))
    after_load(c["load_btn"].click(ctx.job(with_views(load)), [*page.refs, c["force"]], loaded, api_name="load", **ctx.lane,
                                   **page.on))
    c["stop_btn"].click(ctx.job(stop, **quick), None, [page.status], api_name="stop", queue=False)
    c["ticks"].tick(ctx.job(engine_line, **quick), None, [c["engine_now"]], api_visibility="private", queue=False,
                    show_progress="hidden")
    # the share link follows every change of the plan and of the open tab
    page.link = link = dict(fn=ctx.job(share_link, **quick, plan=True), inputs=linked, outputs=page.share,
                            show_progress="hidden", **off)
    gr.on([x.change for x in (*page.plan, page.family_plans)], trigger_mode="always_last", **link)
    for tab_id, item in page.tab_items.items():
        item.select(lambda t=tab_id: t, None, page.tab, **off).then(**link)
    loaded = family.wire(ctx, page, {**c["family"], "force": c["force"], "preset": c["preset"]})
    loaded.success(ctx.job(family_views.menu, **quick), None, [page.family_lang], api_visibility="private",
                   queue=False)  # the analysis tab's language menu: the new family's codes
    family_views.wire_strips(ctx, page, loaded, c["family"])
