"""The lens panel of the analysis tab: what each layer of each model does with one question.

It only calls `layerswap.analysis.lens` (`lens_workbench`, `lens_curves`, `lens_grid`): the logit lens (top tokens and the
probability on target-language, English and digit tokens by layer) and the alignment of the question's states with
its English twin, for math expert, language expert, the visitor's merged plan and the base. The layer axis is the
heatmaps' and the plan's swapped layers are outlined. The class rule is shown with the figures. Stop ends the run
between blocks.
"""

from __future__ import annotations

import gradio as gr

from layerswap.core.errors import whole_number
from layerswap.core.markup import code, text
from layerswap.ui.context import Context, Page
from layerswap.ui.controls import PlanControls
from layerswap.ui.events import Job


def run(ctx: Context, job: Job, lang: str, index, question: str, twin: str, batch, answer_tokens,
        controls: PlanControls):
    from layerswap.analysis.lens import LensConfig, lens_curves, lens_grid, lens_workbench

    question = ctx.policy.check_text(str(question or ""), "question").strip()
    twin = ctx.policy.check_text(str(twin or ""), "English twin").strip()
    cfg = LensConfig(language=str(lang or ""), index=None if question else whole_number(index or 0, "Question", 0, 10**6),
                     question=question or None, twin=(twin or None) if question else None,
                     batch=ctx.policy.lens_batch(batch), answer_tokens=whole_number(answer_tokens or 0, "Answer tokens", 0, 64),
                     source=ctx.data(job.visitor.refs))
    cfg.validate()
    wb = ctx.workbench(job)
    r = controls.recipe
    controls.sources(wb.num_layers)  # the plan against the model, before the lens starts
    with ctx.shared.lock:  # the lens hooks the loaded models (or streams them): nobody generates or rebuilds meanwhile
        res = lens_workbench(wb, cfg, recipe=r, progress=job.part(0.05, 0.95), cancel=job.visitor.stop)
    path = res.write_json(ctx.shared.folder(job.visitor) / "lens.json")
    where = f"MGSM {res.language} question {res.index}" if res.index is not None else "your question"
    md = (f"**{where}**, batch of {len(res.batch_indices)} parallel questions for CKA. Last prompt token: "
          f"{code(res.last_token)}.\n\n**Token classes:** {text(res.rule)}")
    return (md, gr.update(value=lens_curves(res), visible=True), gr.update(value=lens_grid(res), visible=True),
            gr.update(value=str(path), visible=True))


def menu(ctx: Context, refs) -> dict:
    """The target languages of the models' MGSM set (English is the twin), opened on Ask's."""
    codes = [(label, c) for label, c in ctx.langs(refs) if c != "en"]
    first = ctx.opening_question(refs)[0]
    return dict(choices=codes, value=first if any(c == first for _, c in codes) else (codes[0][1] if codes else None))


def render(ctx: Context, page: Page) -> None:
    """Inside the analysis tab, under the heatmaps."""
    with gr.Column(elem_id="lens-panel"):
        gr.Markdown("### What each layer does with the question: the latent-language lens\nEach model's state after every "
                    "layer, decoded through its own final norm and lm_head (which tokens it would say there, and how much "
                    "probability sits on target-language, English and digit tokens), and how close the question's states "
                    "are to its English twin's (cosine; CKA over a batch of parallel questions). The paper's premise: the "
                    "language expert maps the question to English-like states in the bottom layers; the merge keeps that "
                    "below the swap boundary and the math expert's reasoning above it.")
        with gr.Row():
            lang = gr.Dropdown(**menu(ctx, ctx.key), label="Language", elem_id="lens-lang")
            index = gr.Number(0, precision=0, minimum=0, label="MGSM question number", elem_id="lens-index")
            batch = gr.Slider(1, 64, 16, step=1, label="Batch (parallel questions for CKA)", elem_id="lens-batch")
            answer_tokens = gr.Slider(0, 32, 0, step=1, label="Also lens the answers (tokens)", elem_id="lens-answer")
        with gr.Row():
            question = gr.Textbox(label="…or your own question in that language (overrides the number)", scale=2,
                                  elem_id="lens-question")
            twin = gr.Textbox(label="its English twin (optional, for the alignment)", scale=2, elem_id="lens-twin")
        run_btn = gr.Button("Run the lens", elem_id="lens-run")
        summary = gr.Markdown(elem_id="lens-summary")
        curves = gr.Plot(label="Target language, English and alignment by layer", visible=False, elem_id="lens-curves")
        grid = gr.Plot(label="Top token after each layer, by position (coloured by class)", visible=False, elem_id="lens-grid")
        json_file = gr.DownloadButton("Download the numbers (JSON)", visible=False, elem_id="lens-json")
    page.on_models([lang], lambda c, refs: [gr.update(**menu(c, refs))])
    run_btn.click(ctx.job(run, plan=True, models=True),
                  [lang, index, question, twin, batch, answer_tokens, *page.plan, page.models],
                  [summary, curves, grid, json_file], api_name="lens", **ctx.lane, **page.on)
