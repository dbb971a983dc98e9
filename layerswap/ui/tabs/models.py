"""The Models section above the tabs: presets, the three model fields, Load, Stop, and the page's opening.

Opening the page restores a shared link's models, plan and tab (`controls.restore`), then shows the models'
report and builds the plan once the models are there; Load does the same for other models. Both end by
redrawing the analysis.
"""

from __future__ import annotations

import time

import gradio as gr

from ...errors import UserError
from ...plans import default_plan
from ..context import Context, Page
from ..controls import query_string, recipe, restore
from ..events import Job
from ..session import same_recipe


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
    p = ctx.d.plan if refs == ctx.key and ctx.d.plan else default_plan(L)  # the default models' own, else the literature's
    return [report] + [gr.update(maximum=L, value=x) for x in (p.b, p.u, p.tb, p.tu)]


def stop(ctx: Context, job: Job) -> str:
    job.visitor.stop.set()
    return "**Stopping** your running job…"


def open_page(ctx: Context, job: Job):
    """Page open: this tab's plan, tab and models restored from the URL if it has them."""
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
    return [status, *[gr.update(value=r) for r in v.refs], *updates, gr.Tabs(selected=tab or "build")]


def first_view(ctx: Context, job: Job, *values):
    """After the page opened (or Load): the models' report and the plan's strip, as soon as the headers are read
    (no engine needed; the plan is built when answers are asked for)."""
    wb = ctx.workbench(job)
    r = recipe(*values)
    r.validate(wb.num_layers)
    sliders = [gr.update(maximum=wb.num_layers)] * 4
    return [ctx.models_md(wb), *ctx.strip_and_md(wb, r, built=same_recipe(wb, r) and "merged" in wb.engines),
            query_string(job.visitor.refs, values), *sliders]


def render(ctx: Context, page: Page) -> dict:
    """The section's components; `wire` connects them once the tabs exist."""
    d, pol = ctx.d, ctx.policy
    with gr.Group():
        gr.Markdown("### 1 · Models")
        with gr.Row():
            preset = gr.Dropdown([(p.label, k) for k, p in ctx.presets.items()], value=None,
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
        page.report = gr.Markdown("Loading the default models…", elem_id="report")
    return dict(preset=preset, preset_md=preset_md, force=force, load_btn=load_btn, stop_btn=stop_btn)


def wire(ctx: Context, page: Page, demo: gr.Blocks, c: dict) -> None:
    quick = dict(gpu=False, clear_stop=False)
    shown = [page.report, page.strip, page.plan_md, page.share, *page.sliders]
    opened = demo.load(ctx.job(open_page, **quick), None, [page.status, *page.refs, *page.plan, page.tabs],
                       api_visibility="private", queue=False)
    page.redraw(opened.then(ctx.job(first_view, plan=True), page.plan, shown, api_visibility="private", **ctx.lane, **page.on)).then(
        lambda: "Models ready.", None, [page.status], queue=False, api_visibility="private")

    def end(request: gr.Request) -> None:  # the tab was closed: its visitor and files go
        ctx.shared.end(getattr(request, "session_hash", None))

    demo.unload(end)
    c["preset"].change(ctx.job(pick_preset, **quick), [c["preset"]], [*page.refs, c["preset_md"]], api_name="preset",
                       queue=False)
    loaded = c["load_btn"].click(ctx.job(load), [*page.refs, c["force"]], [page.report, *page.sliders], api_name="load",
                                 **ctx.lane, **page.on)
    page.redraw(loaded.then(ctx.job(first_view, plan=True), page.plan, shown, api_visibility="private", **ctx.lane, **page.on))
    c["stop_btn"].click(ctx.job(stop, **quick), None, [page.status], api_name="stop", queue=False)
