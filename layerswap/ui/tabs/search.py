"""Find a plan: the plan search (`layerswap.search`) on the visitor's models, from the Build tab.

Offered wherever the page has an MGSM set (the dev questions come from it). It runs in the models' one lane
with progress (best plan so far, time left); Stop ends it after the current chunk of questions and keeps what
was found. The result is reported honestly (dev optimistic, held-out exact interval, McNemar against the
experts and the default plan), the plan controls are set to the plan found and the merged model holds it.
Records go to the shared search results file (hosted: the visitor's own folder), the one `layerswap search` uses
with the same keys, so a search run again, here or in the CLI, resumes. Models that bring their own dev questions
(a shipped organism's) are searched on those (`search.for_models`); the result says which questions chose.
"""

from __future__ import annotations

import json
from dataclasses import replace

import gradio as gr

from layerswap.core.errors import UserError, whole_number
from layerswap.recipe.fields import FIELDS
from layerswap.ui.context import Context, Page
from layerswap.ui.controls import plan_values
from layerswap.ui.events import Job
from layerswap.ui.tabs.models import stop

INTRO = ("### Find a plan\nTries plans against MGSM questions: each candidate is merged in memory and answers a few "
         "dev questions, and only those not clearly behind the best so far get more. The plan found is scored on "
         "held-out questions the search never saw (shipped models: chosen on their own dev file, as their card "
         "was). Started from the weight-diff prior, the τ rule and the models' own plan (priors, not answers). "
         "Same as `layerswap search`.")


def find_plan(ctx: Context, job: Job, langs, budget, seed, dev, test=0):
    from layerswap.search import SearchConfig, default_results, for_models, search

    v = job.visitor
    langs = list(langs or [])
    if not langs:
        raise UserError("Choose at least one language to search for.")
    budget = whole_number(budget, "Plans to try", 1, 10_000)
    counts = ctx.counts(v.refs)
    total = min((counts.get(c, 0) for c in langs), default=0)
    dev_n = whole_number(dev or 0, "Dev questions", 0, max(total - 1, 0)) or None
    test_n = whole_number(test or 0, "Held-out questions", 0, total) or None
    cfg = for_models(SearchConfig(langs=langs, source=ctx.data(v.refs), budget=budget,
                                  seed=whole_number(seed or 0, "Seed", 0, 2**31 - 1), dev=dev_n, test=test_n),
                     v.refs[1], v.refs[2], v.refs[0] or None)
    if ctx.policy.hosted:  # the held-out set within the server's question cap
        rest = total if cfg.dev_source else total - (dev_n or min(400, max(1, round(0.4 * total))))
        cfg = replace(cfg, test=min(ctx.policy.limits.eval_questions, test_n or rest, rest))
    ctx.policy.check_search(budget, cfg.dev or 0, cfg.test or 0)
    results = ctx.shared.folder(v) / "search-results.jsonl" if ctx.policy.hosted else default_results()
    wb = ctx.workbench(job)
    job.progress(0, "starting the engines")
    wb = ctx.shared.engines(v.refs, job.progress)

    def tick(f: float, d: str) -> None:  # Stop ends the search after its chunk (`cancel`), keeping what was found
        job.bar(f, desc=d)

    with ctx.shared.lock:  # one lane: nobody else rebuilds the merged model while candidates answer
        r = search(v.refs[1], v.refs[2], v.refs[0] or None, cfg, results=results, workbench=wb, force=v.force,
                   progress=tick, cancel=v.stop)
    out = ctx.shared.folder(v) / "search.json"
    d = r.to_dict()
    d["results_file"] = results.name  # no server path in what a visitor downloads
    out.write_text(json.dumps(d, indent=1) + "\n")
    controls = plan_values(r.plan) if r.plan is not None else [gr.update() for _ in FIELDS]
    return [ctx.policy.scrub(r.markdown()), gr.update(value=str(out), visible=True), *controls]


def menu(ctx: Context, refs) -> dict:
    """The languages of the models' MGSM set, their target checked (`Context.opening_question`)."""
    target = ctx.opening_question(refs)[0]
    return dict(choices=ctx.langs(refs), value=[target] if target else [])


def render(ctx: Context, page: Page) -> None:
    """The panel (only when the page has an MGSM set to take dev questions from); wired to `page.plan`."""
    if not ctx.langs(ctx.key):
        return
    with gr.Group(elem_id="find-plan"):
        gr.Markdown(INTRO)
        with gr.Row():
            langs = gr.CheckboxGroup(**menu(ctx, ctx.key), label="Languages", elem_id="find-langs", scale=2)
            budget = gr.Number(40, precision=0, minimum=1, label="Plans to try (budget)", elem_id="find-budget")
            seed = gr.Number(0, precision=0, minimum=0, label="Seed (split and optimiser)", elem_id="find-seed")
            dev = gr.Number(0, precision=0, minimum=0, label="Dev questions (0 = the models' own dev file, else 40 % "
                            "of the set, at most 400)",
                            elem_id="find-dev")
            test = gr.Number(0, precision=0, minimum=0, label="Held-out questions (0 = the rest of the set)",
                             elem_id="find-test")
        with gr.Row():
            find_btn = gr.Button("Find a plan", variant="primary", elem_id="find")
            stop_btn = gr.Button("Stop", variant="stop", elem_id="find-stop")
        status = gr.Markdown("Press **Find a plan**: the controls above are set to what it finds.", elem_id="find-status")
        stopping = gr.Markdown(elem_id="find-stopping")  # Stop's own line: the result replaces the status
        download = gr.DownloadButton("Download the search (JSON)", visible=False, elem_id="find-json")
    page.on_models([langs], lambda c, refs: [gr.update(**menu(c, refs))])
    page.redraw(find_btn.click(ctx.job(find_plan, models=True), [langs, budget, seed, dev, test, page.models],
                               [status, download, *page.plan],
                               api_name="find_plan", **ctx.lane, show_progress_on=[status]))
    stop_btn.click(ctx.job(stop, clear_stop=False), None, [stopping], api_name="stop_search", queue=False)
    find_btn.click(lambda: "", None, [stopping], queue=False, api_visibility="private")
