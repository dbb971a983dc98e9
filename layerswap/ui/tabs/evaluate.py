"""The Evaluate tab: MGSM accuracy of math expert, language expert and merged model, and a browser of the answers.

It only calls the library (`Workbench.evaluate`, `evaluation`, `plots.eval_bars`). The visitor's plan is built
first when the merged model is evaluated. Stop sets the visitor's flag, checked between batches; what is done is
kept and shown. The target languages are preselected.
"""

from __future__ import annotations

import time

import gradio as gr

from layerswap.evaluation import mgsm
from layerswap.core.errors import UserError, whole_number
from layerswap.core.markup import block, code, text
from layerswap.analysis.plots import eval_bars
from layerswap.core.roles import ANSWERING, ROLE_NAMES
from layerswap.ui import family, family_views
from layerswap.ui.context import Context, Page
from layerswap.ui.controls import PlanControls
from layerswap.ui.events import Job
from layerswap.ui.tabs.models import stop

EVAL_ROLES = [(ROLE_NAMES[r], r) for r in ANSWERING]


def evaluate(ctx: Context, job: Job, langs, roles, limit, shots, mode, max_new, controls: PlanControls):
    from layerswap.evaluation.run import EvalConfig

    v = job.visitor
    order = [r for _, r in EVAL_ROLES if r in (roles or [])]
    if not order:
        raise UserError("Choose at least one model to evaluate.")
    limit = whole_number(limit or 0, "Questions per language", 0, 10**6)
    cfg = EvalConfig(langs=list(langs or []), limit=limit or None,
                     shots=whole_number(shots, "Few-shot exemplars", 0, mgsm.TASK.max_shots),
                     mode=mode, max_new_tokens=ctx.policy.new_tokens(max_new), source=ctx.data(v.refs))
    cfg.validate()
    whole = ctx.policy.hosted and not cfg.limit  # only then do the set sizes matter to the server's cap
    ctx.policy.check_eval(cfg.limit, max((ctx.counts(v.refs).get(c, 0) for c in cfg.langs), default=0) if whole else 0)
    job.progress(0, "starting")
    if "merged" in order:
        wb, r = ctx.built(job, controls)
    else:
        ctx.workbench(job)
        wb, r = ctx.shared.engines(v.refs, job.progress), None
    t0 = time.perf_counter()

    def tick(f: float, d: str) -> None:  # Stop ends the evaluation after its batch (`cancel`), keeping what is done
        job.bar(f, desc=d + job.time_left(f))

    with ctx.shared.lock:  # one lane: nobody rebuilds the merged model while it answers
        if r is not None:
            ctx.shared.ensure_built(wb, r)
        report = wb.evaluate(cfg, tuple(order), progress=tick, cancel=v.stop)
    v.last_eval = report
    v.eval_recipe = r.to_dict() if r is not None else None
    path = ctx.shared.folder(v) / "mgsm_results.jsonl"
    report.write_jsonl(path)
    status = (f"**{'Cancelled' if report.cancelled else 'Done'}:** {len(report.results)} answers in "
              f"{time.perf_counter() - t0:.0f} s ({', '.join(f'{m}: {e}' for m, e in report.engines.items())} engine).")
    first = report.results[0] if report.results else None
    return (status, gr.update(value=_table(report), visible=True), gr.update(value=eval_bars(report), visible=True),
            gr.update(value=str(path), visible=True),
            gr.update(choices=list(dict.fromkeys(r.lang for r in report.results)), value=first.lang if first else None),
            _position(report.counts(report.models[0], first.lang) if first else 0),
            _browse(v.last_eval, first.lang if first else None, 0))


def _position(n: int):
    """The browse slider over `n` questions: a slider needs maximum > minimum, so one question fixes it at 0."""
    return gr.update(value=0, maximum=max(1, n - 1), interactive=n > 1)


def stop_eval(ctx: Context, job: Job) -> str:
    """Stop (`models.stop`: says when nothing runs, and when the evaluation has stopped)."""
    return stop(ctx, job)


def browse(ctx: Context, job: Job, lang, position) -> str:
    """One question of the visitor's last evaluation: prompt, each model's output and extractions, gold."""
    return _browse(job.visitor.last_eval, lang, position)


def _browse(rep, lang, position) -> str:
    if rep is None or not lang:
        return "Run an evaluation to browse its questions."
    rows = [r for r in rep.results if r.lang == lang]
    indices = sorted({r.index for r in rows})
    if not indices:
        return f"No answers for {text(str(lang)[:20])} in the last evaluation."
    pos = whole_number(position or 0, "Question", 0, len(indices) - 1)
    qrows = [r for r in rows if r.index == indices[pos]]
    head = (f"**{text(lang)} question {indices[pos]}** ({pos + 1} of {len(indices)}) · gold answer "
            f"**{text(qrows[0].gold)}**\n\n{block(qrows[0].prompt)}\n\n"
            "| model | strict | flexible | correct (flexible) |\n|---|---|---|---|\n")
    table = "".join(f"| {r.model} | {code(r.strict).replace('|', '¦')} | {code(r.flexible).replace('|', '¦')} | "
                    f"{'✓' if r.flexible_correct else '✗'} |\n" for r in qrows)
    outs = "".join(f"\n**{r.model}** ({r.engine})\n\n{block(r.output.strip() or '(empty)')}\n" for r in qrows)
    return head + table + outs


def _table(report):
    import pandas as pd

    metrics = mgsm.TASK.metric_names
    tables = [report.table(k) for k in metrics]
    headers = ["language", "n"] + [f"{m} ({k})" for m in report.models for k in metrics]
    data = [[rows[0]["language"], rows[0]["n"]] + [row[m] for m in report.models for row in rows]
            for rows in zip(*tables)]
    return pd.DataFrame(data, columns=headers)


def protocol() -> dict[str, dict]:
    """The protocol controls' choices and defaults, from MGSM's task (`mgsm.TASK`): 0 shots or all the exemplars
    (lm-eval's two setups), and its prompt modes."""
    t = mgsm.TASK
    return {"shots": dict(choices=sorted({t.shots, t.max_shots}), value=t.shots),
            "mode": dict(choices=[(label, m) for m, label in t.modes], value=t.mode)}


def menus(ctx: Context, refs) -> list[dict]:
    """The language choices of the models' MGSM set (its target languages checked) and the question count."""
    codes = [c for _, c in ctx.langs(refs)]
    targets = [c for c in mgsm.PAPER_LANGS if c in codes] or [c for c in codes if c != "en"] or codes[:1]
    counts = ctx.counts(refs)
    sizes = sorted({counts[c] for c in codes if c in counts})
    size_txt = (f"{sizes[0]:,}" if len(sizes) == 1 else f"{sizes[0]:,}-{sizes[-1]:,}") if sizes else "all"
    cap = f"; this server: at most {ctx.policy.limits.eval_questions:,}" if ctx.policy.hosted else ""
    return [dict(choices=ctx.langs(refs), value=targets), dict(label=f"Questions per language (0 = all {size_txt}{cap})")]


def render(ctx: Context, page: Page) -> None:
    with gr.Tab("Evaluate", id="evaluate", elem_id="tab-evaluate") as page.tab_items["evaluate"]:
        gr.Markdown("### MGSM evaluation: math expert vs language expert vs merged model\n"
                    f"lm-evaluation-harness `mgsm_{mgsm.TASK.mode}` by default (greedy, native stop words, strict "
                    "and flexible extraction, exact match); every question of the chosen languages unless "
                    "limited. The merged model is your current plan (built first if needed). Per-question "
                    "results download as JSONL.")
        lang_menu, limit_label = menus(ctx, ctx.key)
        with gr.Row():
            langs = gr.CheckboxGroup(**lang_menu, label="Languages", elem_id="eval-langs")
            roles = gr.CheckboxGroup(EVAL_ROLES, value=["math", "lang", "merged"], label="Models", elem_id="eval-models")
        with gr.Row():
            limit = gr.Number(0, precision=0, minimum=0, elem_id="eval-limit", **limit_label)
            shots = gr.Radio(**protocol()["shots"], label="Few-shot exemplars", elem_id="eval-shots")
            mode = gr.Radio(**protocol()["mode"], label="Protocol", elem_id="eval-mode")
            max_new = gr.Slider(16, 512, mgsm.MAX_NEW_TOKENS, step=16, label="Max new tokens")
        with gr.Row():
            run_btn = gr.Button("Evaluate", variant="primary", elem_id="eval-run")
            stop_btn = gr.Button("Stop", variant="stop", elem_id="eval-stop")
        status = gr.Markdown("Choose languages and models, then Evaluate.", elem_id="eval-status")
        table = gr.Dataframe(value=None, label="Accuracy (%) per language, then average and max", interactive=False,
                             elem_id="eval-table", visible=False)
        bars = gr.Plot(label="Accuracy per language (experts as reference marks)", elem_id="eval-bars", visible=False)
        results = gr.File(label="Per-question results (JSONL)", visible=False, elem_id="eval-file")
        gr.Markdown("#### Browse the answers")
        with gr.Row():
            b_lang = gr.Dropdown([], label="Language", elem_id="eval-browse-lang", allow_custom_value=True)
            b_pos = gr.Slider(0, 249, 0, step=1, label="Question", elem_id="eval-browse-pos")
        detail = gr.Markdown("Run an evaluation to browse its questions.", elem_id="eval-detail")
        fam = family.render_eval(ctx, page, limit, shots, mode, max_new)
        family_views.render_export(ctx, page)
    page.on_models([langs, limit], lambda c, refs: [gr.update(**m) for m in menus(c, refs)])
    quick = dict(clear_stop=False)
    run_btn.click(ctx.job(evaluate, plan=True, models=True),
                  [langs, roles, limit, shots, mode, max_new, *page.plan, page.models],
                  [status, table, bars, results, b_lang, b_pos, detail], api_name="evaluate", **ctx.lane,
                  show_progress_on=[status])
    stop_btn.click(ctx.job(stop_eval, **quick), None, [status], api_name="stop_eval", queue=False)
    fam["stop"].click(ctx.job(stop_eval, **quick), None, [fam["status"]], api_name="stop_family", queue=False)
    gr.on([b_lang.change, b_pos.release], ctx.job(browse, **quick), [b_lang, b_pos], [detail], api_name="browse",
          queue=False)
