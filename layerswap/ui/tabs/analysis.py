"""The "Where each expert changed" tab: heatmaps, depth profile, tables, the weight-diff prior.

It is filled when the models are loaded (no click needed) and redrawn when its controls or the plan change
(`Page.redraw`: the one place that wiring lives); the visitor's plan is drawn on top.
"""

from __future__ import annotations

import gradio as gr

from layerswap.analysis import PANELS, format_row, write_csv
from layerswap.core.errors import UserError
from layerswap.core.markup import text
from layerswap.recipe.sources import Sources
from layerswap.analysis.plots import analysis_heatmaps, layer_profile
from layerswap.ui.context import Context, Page
from layerswap.ui.controls import PlanControls
from layerswap.ui.events import Job
from layerswap.ui import family_views
from layerswap.ui.tabs import lens

K_CHOICES = [0.1, 0.5, 1.0, 2.0, 5.0, 10.0]
DEFAULT_PANELS = ["math", "lang", "overlap", "merged"]
METRICS = ("relative", "mean_abs", "topk")
METRIC_CHOICES = [("relative change ‖Δ‖/‖θ_base‖", "relative"), ("mean |Δ|", "mean_abs"),
                  ("share of the top-k% most-changed entries", "topk")]
TOP_ROWS = 20
NO_BASE = ("**No base model loaded.** The heatmaps compare each expert with the model both were fine-tuned "
           "from: give the base above and press Load.")


def _table(rows: list[dict]) -> dict:
    """Rows of dicts as the headers + data a gr.Dataframe takes."""
    headers: list[str] = []
    for r in rows:
        headers += [k for k in r if k not in headers]
    return {"headers": headers, "data": [[r.get(h, "") for h in headers] for r in rows]}


def view(ctx: Context, job: Job, panels, metric, overlap_metric, k, norm, plans, controls: PlanControls):
    """Everything in the tab for the controls and the visitor's plan (no overlay for methods without one), for the
    pair above or the family's language chosen in the menu (`family_views.pair_view`), whose own plan (`plans`, the
    per-language plans) is drawn when it has one."""
    wb = ctx.workbench(job)
    if "base" not in wb.checkpoints and family_views.chosen(job.visitor) is None:
        return [gr.update(visible=False), NO_BASE] + [gr.update(visible=False)] * 4
    recipe = family_views.overlay(job.visitor, plans, controls)
    plan = recipe.plan  # None for methods without a layer map: no overlay
    k = float(k) if k not in (None, "") else 1.0
    with ctx.shared.lock, family_views.pair_view(job.visitor, wb, k, job.part(0, 0.9)) as (an, merged_of, who):
        note = who if recipe is controls.recipe else f"{who}**Its own plan:** {text(recipe.title())}.\n\n"
        if plan is not None:
            try:  # the plan against the model
                controls.sources(an.num_layers) if recipe is controls.recipe else Sources(recipe, an.num_layers)
            except UserError as e:
                plan, note = None, f"{who}**No plan overlay:** {e}\n\n"
        merged = merged_of(plan) if plan is not None else None
    panels = [x for x in (panels or []) if merged is not None or not x.startswith("merged")]
    heat = analysis_heatmaps(an, panels or ["math", "lang"], metric=metric, overlap_metric=overlap_metric, k=k,
                             norm=norm, merged=merged, plan=plan)
    prof = layer_profile(an, metric if metric in METRICS else "relative", k, merged, plan, norm)
    nonlayer = _table([format_row(r) for r in an.non_layer_rows(k, merged)])
    ranked = an.most_changed(len(an.tensors) * 2, by=metric, k=k)
    csv_path = ctx.shared.folder(job.visitor) / f"most-changed-{metric}-k{k:g}.csv"
    write_csv(ranked, csv_path)
    top = _table([format_row(r) for r in ranked[:TOP_ROWS]])
    shown = [gr.update(value=x, visible=True) for x in (heat, prof, nonlayer, top)]
    return [shown[0], note + an.report(k, merged), *shown[1:], gr.update(value=str(csv_path), visible=True)]


def pick_language(ctx: Context, job: Job, lang, panels, metric, overlap_metric, k, norm, plans,
                  controls: PlanControls):
    """The menu's pair (the pair above, or one language of the visitor's family), kept for the tab's next views."""
    family_views.choose(job.visitor, lang)
    return view(ctx, job, panels, metric, overlap_metric, k, norm, plans, controls)


def suggest(ctx: Context, job: Job, metric, k):
    """The weight-diff prior's b, u, tb, tu on the sliders (a prior, not an answer: Find a plan tests plans)."""
    wb = ctx.workbench(job)
    if "base" not in wb.checkpoints and family_views.chosen(job.visitor) is None:
        raise UserError("Suggesting a plan needs the analysis against the base: load a base model too.")
    k = float(k) if k not in (None, "") else 1.0
    with ctx.shared.lock, family_views.pair_view(job.visitor, wb, k) as (an, _, _):
        pass
    s = an.suggest_plan(metric if metric in METRICS else "relative", k)
    md = s.markdown()
    if not any((s.plan.b, s.plan.u, s.plan.tb, s.plan.tu)):
        md += ("\n\n**b = u = 0 means no bottom or top layer is dominated by the language expert** under this "
               "metric: the rule found nothing to swap, so it keeps the math expert. Try another metric or k, "
               "or set the plan by hand.")
    return [gr.update(value=x) for x in (s.plan.b, s.plan.u, s.plan.tb, s.plan.tu)] + [md]


def render(ctx: Context, page: Page) -> None:
    with gr.Tab("Where each expert changed", id="analysis", elem_id="tab-analysis") as tab:
        page.tab_items["analysis"] = tab
        gr.Markdown("### Where each expert changed\nEach cell is one tensor (layer × parameter type); your "
                    "plan is drawn on top (outlined: from the language expert, shaded: blended). A "
                    "reconstruction of the paper's analysis: its exact metric and normalisation are not in its "
                    "public text, so several are offered.")
        with gr.Row():
            lang = gr.Dropdown([("the pair above", family_views.PAIR)], value=family_views.PAIR, visible=False,
                               label="Language expert (a loaded family's: its pair with the math expert)",
                               elem_id="family-lang", allow_custom_value=True, scale=2)  # checked by the handler
            page.family_lang = lang
            panels = gr.CheckboxGroup([(label, key) for key, label in PANELS.items()], value=DEFAULT_PANELS,
                                      label="Panels", elem_id="panels", scale=3)
            metric = gr.Radio(METRIC_CHOICES, value="relative", label="Metric", elem_id="metric", scale=2)
        with gr.Row():
            overlap_metric = gr.Radio([("cosine of the task vectors", "cosine"),
                                       ("Jaccard of the top-k% sets", "jaccard")], value="cosine",
                                      label="Overlap panel", elem_id="overlap-metric")
            k = gr.Dropdown(K_CHOICES, value=1.0, label="k (% of all entries)", elem_id="k",
                            info="a new k streams the models once more (then cached)")
            norm = gr.Radio([("raw", "raw"), ("per row", "row"), ("log", "log")], value="raw",
                            label="Normalisation", elem_id="norm")
        summary_md = gr.Markdown("The heatmaps appear here once the models are loaded.", elem_id="analysis-summary")
        heat = gr.Plot(label="Change from the base, per layer and parameter type", elem_id="heatmap", visible=False)
        profile = gr.Plot(label="Change by depth", elem_id="profile", visible=False)
        with gr.Row():
            suggest_btn = gr.Button("The weight-diff prior (sets the sliders)", elem_id="suggest")
        suggest_md = gr.Markdown(elem_id="suggestion")
        nonlayer_df = gr.Dataframe(value=None, label="Embeddings, final norm, lm_head (outside the layer grid)",
                                   elem_id="non-layer", interactive=False, visible=False)
        top_df = gr.Dataframe(value=None, label=f"Most-changed tensors (top {TOP_ROWS} by the chosen metric)",
                              elem_id="top-table", interactive=False, visible=False)
        top_csv = gr.DownloadButton("Download the full ranking (CSV)", visible=False, elem_id="top-csv")
        lens.render(ctx, page)
    controls = [panels, metric, overlap_metric, k, norm]
    outputs = [heat, summary_md, profile, nonlayer_df, top_df, top_csv]
    handler = ctx.job(view, plan=True, models=True)
    inputs = [*controls, page.family_plans, *page.plan, page.models]
    # redrawn when its controls change and whenever the tab is opened (the plan may have changed)
    gr.on([c.change for c in controls] + [tab.select], handler, inputs, outputs,
          api_name="heatmap", trigger_mode="always_last", **ctx.lane, **page.on)
    lang.input(ctx.job(pick_language, plan=True, models=True), [lang, *inputs], outputs, api_name="family_heatmap",
               **ctx.lane, **page.on)
    tab.select(ctx.job(family_views.menu, clear_stop=False), None, [lang], api_visibility="private", queue=False)
    redraw = ctx.job(view, plan=True, models="redraw")  # queued behind a Load, it would show the old models: dropped
    page.set_redraw(lambda dep: dep.then(redraw, inputs, outputs, api_visibility="private", **ctx.lane, **page.on))
    page.redraw(suggest_btn.click(ctx.job(suggest, models=True), [metric, k, page.models], [*page.sliders, suggest_md], api_name="weight_diff_prior",
                                  **ctx.lane, **page.on))
