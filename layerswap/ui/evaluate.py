"""The app's Evaluate tab: MGSM accuracy of math expert, language expert and merged model.

A mixin of `layerswap.ui.app.App` (it uses the app's workbench, data folder and language list); like the
rest of the UI it only calls the library (`Workbench.evaluate`, `evaluation`, `plots.eval_bars`).
Stop sets a flag that the evaluation checks between batches; what is done is kept and shown.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import gradio as gr

from .. import mgsm
from ..errors import UserError
from ..plots import eval_bars
from ..roles import ANSWERING, ROLE_NAMES
from .events import errors_as_gradio

EVAL_ROLES = [(ROLE_NAMES[r], r) for r in ANSWERING]


class EvaluateTab:
    """Evaluate-tab events and layout; mixed into `App`."""

    def evaluate(self, langs, roles, limit, shots, mode, max_new, progress=gr.Progress()):
        from ..evaluation import EvalConfig

        if not roles:
            raise UserError("Choose at least one model to evaluate.")
        cfg = EvalConfig(langs=list(langs or []), limit=int(limit) if limit else None, shots=int(shots), mode=mode,
                         max_new_tokens=int(max_new), source=self._source())
        cfg.validate()
        self._cancel.clear()
        progress(0, desc="starting")
        order = [r for _, r in EVAL_ROLES if r in roles]
        report = self.wb.evaluate(cfg, tuple(order), progress=lambda f, d: progress(f, desc=d), cancel=self._cancel)
        self.last_eval = report
        path = Path(tempfile.mkdtemp(prefix="layerswap-eval-")) / "mgsm_results.jsonl"
        report.write_jsonl(path)
        n = len(report.results)
        status = (f"**{'Cancelled' if report.cancelled else 'Done'}:** {n} answers "
                  f"({', '.join(f'{m}: {report.engines[m]}' for m in report.engines)} engine). "
                  f"Engine: {self.wb.engine_note}")
        first = report.results[0] if report.results else None
        return (status, self._eval_table(report), eval_bars(report), gr.update(value=str(path), visible=True),
                gr.update(choices=list(dict.fromkeys(r.lang for r in report.results)),
                          value=first.lang if first else None),
                gr.update(value=0, maximum=max(0, report.counts(report.models[0], first.lang) - 1) if first else 0),
                self.browse(first.lang if first else None, 0))

    def stop_eval(self):
        self._cancel.set()
        return "**Stopping** after the current batch…"

    def browse(self, lang, position):
        """One question of the last evaluation: prompt, each model's output and extractions, gold."""
        rep = self.last_eval
        if rep is None or not lang:
            return "Run an evaluation to browse its questions."
        rows = [r for r in rep.results if r.lang == lang]
        indices = sorted({r.index for r in rows})
        if not indices:
            return f"No answers for {lang} in the last evaluation."
        pos = min(max(int(position or 0), 0), len(indices) - 1)
        qrows = [r for r in rows if r.index == indices[pos]]
        head = (f"**{lang} question {indices[pos]}** ({pos + 1} of {len(indices)}) · gold answer **{qrows[0].gold}**"
                f"\n\n```\n{qrows[0].prompt}\n```\n\n| model | strict | flexible | correct (flexible) |\n|---|---|---|---|\n")
        table = "".join(f"| {r.model} | `{r.strict}` | `{r.flexible}` | {'✓' if r.flexible_correct else '✗'} |\n"
                        for r in qrows)
        outs = "".join(f"\n**{r.model}** ({r.engine})\n\n```\n{r.output.strip() or '(empty)'}\n```\n" for r in qrows)
        return head + table + outs

    def _eval_table(self, report):
        flex, strict = report.table("flexible"), report.table("strict")
        headers = ["language", "n"] + [f"{m} ({k})" for m in report.models for k in ("flexible", "strict")]
        data = []
        for f, s in zip(flex, strict):
            data.append([f["language"], f["n"]] + [v for m in report.models for v in (f[m], s[m])])
        import pandas as pd

        return pd.DataFrame(data, columns=headers)

    def _evaluate_tab(self, model_q: dict) -> None:
        with gr.Tab("Evaluate", id="evaluate", elem_id="tab-evaluate"):
            gr.Markdown("### MGSM evaluation: math expert vs language expert vs merged model\n"
                        "lm-evaluation-harness `mgsm_native_cot` by default (greedy, native stop words, strict "
                        "and flexible extraction, exact match); every question of the chosen languages unless "
                        "limited. Per-question results download as JSONL.")
            codes = [c for _, c in self._langs()]
            default = [c for c in mgsm.PAPER_LANGS if c in codes] or codes[:1]
            with gr.Row():
                langs = gr.CheckboxGroup(self._langs(), value=default, label="Languages", elem_id="eval-langs")
                roles = gr.CheckboxGroup(EVAL_ROLES, value=["math", "lang", "merged"], label="Models",
                                         elem_id="eval-models")
            with gr.Row():
                limit = gr.Number(0, precision=0, minimum=0, label="Questions per language (0 = all 250)",
                                  elem_id="eval-limit")
                shots = gr.Radio([0, 8], value=0, label="Few-shot exemplars", elem_id="eval-shots")
                mode = gr.Radio([("native CoT (mgsm_native_cot)", "native_cot"), ("direct (mgsm_direct)", "direct")],
                                value="native_cot", label="Protocol", elem_id="eval-mode")
                max_new = gr.Slider(16, 512, mgsm.MAX_NEW_TOKENS, step=16, label="Max new tokens")
            with gr.Row():
                run_btn = gr.Button("Evaluate", variant="primary", elem_id="eval-run")
                stop_btn = gr.Button("Stop", variant="stop", elem_id="eval-stop")
            status = gr.Markdown(elem_id="eval-status")
            table = gr.Dataframe(label="Accuracy (%) per language, then average and max", interactive=False,
                                 elem_id="eval-table")
            bars = gr.Plot(label="Accuracy per language", elem_id="eval-bars")
            results = gr.File(label="Per-question results (JSONL)", visible=False, elem_id="eval-file")
            gr.Markdown("#### Browse the answers")
            with gr.Row():
                b_lang = gr.Dropdown([], label="Language", elem_id="eval-browse-lang")
                b_pos = gr.Slider(0, 249, 0, step=1, label="Question", elem_id="eval-browse-pos")
            detail = gr.Markdown(elem_id="eval-detail")
        run_btn.click(errors_as_gradio(self.evaluate), [langs, roles, limit, shots, mode, max_new],
                      [status, table, bars, results, b_lang, b_pos, detail], api_name="evaluate", **model_q)
        stop_btn.click(self.stop_eval, None, [status], api_name="stop_eval", queue=False)
        gr.on([b_lang.change, b_pos.release], self.browse, [b_lang, b_pos], [detail], api_name="browse",
              queue=False)
