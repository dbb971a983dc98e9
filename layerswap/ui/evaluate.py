"""The app's Evaluate tab: MGSM accuracy of math expert, language expert and merged model.

A mixin of `layerswap.ui.app.App` (it uses the visitor's models, the data folder and language list); like the
rest of the UI it only calls the library (`Workbench.evaluate`, `evaluation`, `plots.eval_bars`). The
visitor's plan is built first when the merged model is evaluated. Stop sets the visitor's flag, checked
between batches; what is done is kept and shown. The target languages are preselected.
"""

from __future__ import annotations

import time

import gradio as gr

from .. import mgsm
from ..errors import UserError, whole_number
from ..plots import eval_bars
from ..roles import ANSWERING, ROLE_NAMES
from .analysis_tab import TabIO

EVAL_ROLES = [(ROLE_NAMES[r], r) for r in ANSWERING]


class EvaluateTab:
    """Evaluate-tab events and layout; mixed into `App`."""

    # ---- the MGSM data the page offers (also the Ask section's) ------------------------------
    def _langs(self) -> list[tuple[str, str]]:
        src = self.d.mgsm_dir
        langs = mgsm.languages(src)
        return [(f"{langs[c].name} ({c})", c) for c in mgsm.available_languages(src) if c in langs]

    def _default_lang(self) -> str | None:
        codes = [c for _, c in self._langs()]
        for c in (self.d.default_lang, "xx", "sw", "en"):
            if c in codes:
                return c
        return codes[0] if codes else None

    def _question_choices(self, lang: str | None) -> list[tuple[str, int]]:
        if not lang:
            return []
        try:
            items = mgsm.load(lang, self.d.mgsm_dir)
        except UserError:
            return []
        return [(f"{it.index}: {it.question[:90]}{'…' if len(it.question) > 90 else ''}", it.index) for it in items]

    def evaluate(self, job, langs, roles, limit, shots, mode, max_new, *plan_values):
        from ..evaluation import EvalConfig

        v = job.visitor
        if not roles:
            raise UserError("Choose at least one model to evaluate.")
        limit = whole_number(limit or 0, "Questions per language", 0, 10**6)
        cfg = EvalConfig(langs=list(langs or []), limit=limit or None, shots=whole_number(shots, "Few-shot exemplars", 0, 8),
                         mode=mode, max_new_tokens=self.policy.new_tokens(max_new), source=self.d.mgsm_dir)
        cfg.validate()
        whole = self.policy.hosted and not cfg.limit  # only then do the set sizes matter to the server's cap
        self.policy.check_eval(cfg.limit, max((self._counts().get(c, 0) for c in cfg.langs), default=0) if whole else 0)
        job.progress(0, "starting")
        order = [r for _, r in EVAL_ROLES if r in roles]
        wb, r = self.built(job, plan_values) if "merged" in order else (self.workbench(job), None)
        t0 = time.perf_counter()

        def tick(f: float, d: str) -> None:  # Stop ends the evaluation after its batch (`cancel`), keeping what is done
            left = (time.perf_counter() - t0) * (1 - f) / f if f > 0.02 else None
            job.bar(f, desc=d + (f" · about {left:.0f} s left" if left is not None else ""))

        with self.shared.lock:  # one lane: nobody rebuilds the merged model while it answers
            if r is not None:
                self.shared.ensure_built(wb, r)
            report = wb.evaluate(cfg, tuple(order), progress=tick, cancel=v.stop)
        v.last_eval = report
        v.eval_recipe = r.to_dict() if r is not None else None
        path = self.shared.folder(v) / "mgsm_results.jsonl"
        report.write_jsonl(path)
        n = len(report.results)
        status = (f"**{'Cancelled' if report.cancelled else 'Done'}:** {n} answers in {time.perf_counter() - t0:.0f} s "
                  f"({', '.join(f'{m}: {report.engines[m]}' for m in report.engines)} engine).")
        first = report.results[0] if report.results else None
        return (status, gr.update(value=self._eval_table(report), visible=True),
                gr.update(value=eval_bars(report), visible=True), gr.update(value=str(path), visible=True),
                gr.update(choices=list(dict.fromkeys(r.lang for r in report.results)),
                          value=first.lang if first else None),
                gr.update(value=0, maximum=max(0, report.counts(report.models[0], first.lang) - 1) if first else 0),
                self._browse(v, first.lang if first else None, 0))

    def _counts(self) -> dict[str, int]:
        """Questions per language in the data folder (what "0 = all" means)."""
        out = {}
        for _, c in self._langs():
            try:
                out[c] = len(mgsm.load(c, self.d.mgsm_dir))
            except UserError:
                pass
        return out

    def stop_eval(self, job):
        job.visitor.stop.set()
        return "**Stopping** after the current batch…"

    def browse(self, job, lang, position):
        """One question of the visitor's last evaluation: prompt, each model's output and extractions, gold."""
        return self._browse(job.visitor, lang, position)

    def _browse(self, v, lang, position) -> str:
        rep = v.last_eval
        if rep is None or not lang:
            return "Run an evaluation to browse its questions."
        rows = [r for r in rep.results if r.lang == lang]
        indices = sorted({r.index for r in rows})
        if not indices:
            return f"No answers for {str(lang)[:20]} in the last evaluation."
        pos = whole_number(position or 0, "Question", 0, len(indices) - 1)
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

    def _evaluate_tab(self) -> TabIO:
        with gr.Tab("Evaluate", id="evaluate", elem_id="tab-evaluate"):
            gr.Markdown("### MGSM evaluation: math expert vs language expert vs merged model\n"
                        "lm-evaluation-harness `mgsm_native_cot` by default (greedy, native stop words, strict "
                        "and flexible extraction, exact match); every question of the chosen languages unless "
                        "limited. The merged model is your current plan (built first if needed). Per-question "
                        "results download as JSONL.")
            codes = [c for _, c in self._langs()]
            targets = [c for c in mgsm.PAPER_LANGS if c in codes] or [c for c in codes if c != "en"] or codes[:1]
            counts = self._counts()
            sizes = sorted({counts[c] for c in codes if c in counts})
            size_txt = (f"{sizes[0]:,}" if len(sizes) == 1 else f"{sizes[0]:,}-{sizes[-1]:,}") if sizes else "all"
            cap = f"; this server: at most {self.policy.limits.eval_questions:,}" if self.policy.hosted else ""
            with gr.Row():
                langs = gr.CheckboxGroup(self._langs(), value=targets, label="Languages", elem_id="eval-langs")
                roles = gr.CheckboxGroup(EVAL_ROLES, value=["math", "lang", "merged"], label="Models",
                                         elem_id="eval-models")
            with gr.Row():
                limit = gr.Number(0, precision=0, minimum=0, elem_id="eval-limit",
                                  label=f"Questions per language (0 = all {size_txt}{cap})")
                shots = gr.Radio([0, 8], value=0, label="Few-shot exemplars", elem_id="eval-shots")
                mode = gr.Radio([("native CoT (mgsm_native_cot)", "native_cot"), ("direct (mgsm_direct)", "direct")],
                                value="native_cot", label="Protocol", elem_id="eval-mode")
                max_new = gr.Slider(16, 512, mgsm.MAX_NEW_TOKENS, step=16, label="Max new tokens")
            with gr.Row():
                run_btn = gr.Button("Evaluate", variant="primary", elem_id="eval-run")
                stop_btn = gr.Button("Stop", variant="stop", elem_id="eval-stop")
            status = gr.Markdown("Choose languages and models, then Evaluate.", elem_id="eval-status")
            table = gr.Dataframe(value=None, label="Accuracy (%) per language, then average and max", interactive=False,
                                 elem_id="eval-table", visible=False)
            bars = gr.Plot(label="Accuracy per language (experts as reference marks)", elem_id="eval-bars",
                           visible=False)
            results = gr.File(label="Per-question results (JSONL)", visible=False, elem_id="eval-file")
            gr.Markdown("#### Browse the answers")
            with gr.Row():
                b_lang = gr.Dropdown([], label="Language", elem_id="eval-browse-lang", allow_custom_value=True)
                b_pos = gr.Slider(0, 249, 0, step=1, label="Question", elem_id="eval-browse-pos")
            detail = gr.Markdown("Run an evaluation to browse its questions.", elem_id="eval-detail")
        return TabIO([langs, roles, limit, shots, mode, max_new], [status, table, bars, results, b_lang, b_pos, detail],
                     {"run": run_btn, "stop": stop_btn})

    def _wire_evaluate(self, io: TabIO, plan_inputs, lane: dict, on: dict) -> None:
        status = io.outputs[0]
        quick = dict(gpu=False, clear_stop=False)
        io.extra["run"].click(self.event(self.evaluate), [*io.inputs, *plan_inputs],
                              io.outputs, api_name="evaluate", **lane, show_progress_on=[status])
        io.extra["stop"].click(self.event(self.stop_eval, **quick), None, [status], api_name="stop_eval", queue=False)
        b_lang, b_pos, detail = io.outputs[4:]
        gr.on([b_lang.change, b_pos.release], self.event(self.browse, **quick), [b_lang, b_pos], [detail],
              api_name="browse", queue=False)
