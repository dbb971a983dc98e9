"""The Ask section of the Build tab: one question to math expert, language expert and merged model.

A question from the MGSM set of a language, or the visitor's own text in that language's prompt format
(`mgsm.prompt_for`, the prompt the evaluation uses). The visitor's plan is built first if needed; the
three answers appear as each model finishes.
"""

from __future__ import annotations

import gradio as gr

from layerswap.evaluation import mgsm
from layerswap.core.errors import UserError
from layerswap.core.markup import block, code, text
from layerswap.serving.workbench import ROLE_NAMES, Answer
from layerswap.ui.context import Context, Page
from layerswap.ui.controls import PlanControls, plan_md
from layerswap.ui.events import Job

ROLES = ("math", "lang", "merged")


def question_menu(ctx: Context, lang: str | None, refs) -> dict:
    """The questions of `lang` in the models' set, on the one Ask opens on for that language
    (`Context.opening_question`), else the first."""
    choices = ctx.question_choices(lang, refs)
    first, index = ctx.opening_question(refs)
    index = index if lang == first and any(i == index for _, i in choices) else (choices[0][1] if choices else None)
    return dict(choices=choices, value=index, info=None if choices else "No MGSM data here: start the app with "
                "--mgsm-dir (a folder of mgsm_XX.tsv) or go online; free text works.")


def questions(ctx: Context, job: Job, lang: str):
    """The language menu changed (or was closed without a change: then the question stays where it opened)."""
    return gr.update(**question_menu(ctx, lang, job.visitor.refs))


def menus(ctx: Context, refs) -> list[dict]:
    """The language and question menus for the models' MGSM set, opened on `Context.opening_question`."""
    lang = ctx.opening_question(refs)[0]
    return [dict(choices=ctx.langs(refs), value=lang), question_menu(ctx, lang, refs)]


def ask(ctx: Context, job: Job, lang: str, index, free_text: str, max_new_tokens, controls: PlanControls):
    if not lang:
        raise UserError("Choose a language.")
    free_text = ctx.policy.check_text(free_text or "", "question").strip()
    max_new_tokens = ctx.policy.new_tokens(max_new_tokens)
    if not free_text and index is None:
        raise UserError("Pick a question, or type your own.")
    p = mgsm.prompt_for(lang, question=free_text or None, index=None if free_text else index,
                        source=ctx.data(job.visitor.refs))
    wb, r = ctx.built(job, controls)
    strip, pmd = ctx.strip_and_md(wb, controls, built=True)
    title = plan_md(controls.sources(wb.num_layers), True, short=True)
    head = f"**Prompt** (greedy, MGSM native CoT; answers from {title})"
    head += f"\n\n{block(p.prompt)}" + (f"\n\n**Gold answer: {text(p.gold)}**" if p.gold is not None else "")
    cols = [f"**{ROLE_NAMES[role]}** · answering…" for role in ROLES]
    yield [head, *cols, strip, pmd]
    for i, role in enumerate(ROLES):
        with ctx.shared.lock:  # never held across a yield: the next step may run on another thread
            ctx.shared.ensure_built(wb, r)  # another visitor may have built in between
            (a,) = wb.ask(p.prompt, p.language, p.gold, roles=(role,), max_new_tokens=max_new_tokens)
        cols[i] = _answer_md(a)
        yield [head, *cols, strip, pmd]


def start_engines(ctx: Context, job: Job) -> str:
    """Load the engines now, even where a question takes minutes (the page said how long before)."""
    ctx.workbench(job)
    wb = ctx.shared.engines(job.visitor.refs, job.progress, slow_ok=True)
    return ctx.models_md(wb)


EMPTY = "(empty)"  # how an empty answer is shown


def _answer_md(a: Answer) -> str:
    s = a.scored
    verdict = "" if a.gold is None else " · **correct**" if s.flexible_correct else " · **wrong**"
    out = s.output.strip() or EMPTY
    return (f"**{a.model}** · {a.engine} · {a.seconds:.1f}s\n\n{block(out)}\n\n"
            f"strict: {code(s.strict)} · flexible: {code(s.flexible)}{verdict}")


def render(ctx: Context, page: Page) -> None:
    pol = ctx.policy
    with gr.Group():
        gr.Markdown("### 3 · Ask: math expert vs language expert vs merged")
        lang_menu, question_menu = menus(ctx, ctx.key)
        with gr.Row():
            mlang = gr.Dropdown(**lang_menu, label="MGSM language", elem_id="mgsm-lang")
            question = gr.Dropdown(**question_menu, label="Question from the set", elem_id="question", scale=3)
            max_new = gr.Slider(16, 512, mgsm.MAX_NEW_TOKENS, step=16, label="Max new tokens")
        free = gr.Textbox(label="…or your own question (overrides the set; prompted in the chosen language's format)",
                          lines=2, elem_id="free", max_length=pol.limits.text_chars if pol.hosted else None,
                          placeholder="e.g. Tom has 3 apples. Tom buys 4 more apples. "
                                      "How many apples does Tom have now?")
        with gr.Row():
            ask_btn = gr.Button("Ask all three", variant="primary", elem_id="ask", scale=3)
            start_btn = gr.Button("Start engines", elem_id="start-engines", scale=1)
        prompt_md = gr.Markdown(elem_id="prompt")
        with gr.Row():
            answers = [gr.Markdown(f"**{ROLE_NAMES[r]}**", elem_id=f"answer-{r}") for r in ROLES]
    page.on_models([mlang, question], lambda c, refs: [gr.update(**m) for m in menus(c, refs)])
    # the visitor's own choice (a Load sets both menus itself); quick: never waits behind the lane
    mlang.input(ctx.job(questions, clear_stop=False), [mlang], [question], api_name="questions", queue=False)
    start_btn.click(ctx.job(start_engines, models=True), [page.models], [page.report], api_name="start_engines", **ctx.lane, **page.on)
    # at once, off the queue: the old answers go, so none sits under the new plan's header while Ask waits its turn
    ask_btn.click(lambda: ["*Waiting for the models' turn…*", *[f"**{ROLE_NAMES[r]}** · waiting…" for r in ROLES]],
                  None, [prompt_md, *answers], queue=False, api_visibility="private", show_progress="hidden")
    ask_btn.click(ctx.job(ask, plan=True, models=True), [mlang, question, free, max_new, *page.plan, page.models],
                  [prompt_md, *answers, page.strip, page.plan_md], api_name="ask", **ctx.lane, **page.on)
