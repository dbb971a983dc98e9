"""The Gradio app. It only calls the library (`Workbench`, `mgsm`, `plots`).

One `Workbench` holds the loaded models for everybody using this app process (a research tool
on one machine or one Space); model-touching events share one queue so they never race.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
import threading
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from .. import mgsm
from ..analysis import PANELS, format_row, write_csv
from ..errors import UserError
from ..methods import METHODS, MethodConfig
from ..plans import KINDS, MODULES, NON_LAYER_OPTIONS, Plan, default_plan
from ..recipes import Recipe
from ..plots import analysis_heatmaps, layer_profile, layer_strip
from .evaluate import EvaluateTab
from .events import errors_as_gradio
from ..workbench import ROLE_NAMES, Answer, Workbench

MAX_SLIDER = 64
ZIP_LIMIT_BYTES = 2 * 10**9
K_CHOICES = [0.1, 0.5, 1.0, 2.0, 5.0, 10.0]
DEFAULT_PANELS = ["math", "lang", "overlap", "merged"]
METRIC_CHOICES = [("relative change ‖Δ‖/‖θ_base‖", "relative"), ("mean |Δ|", "mean_abs"),
                  ("share of the top-k% most-changed entries", "topk")]
TOP_ROWS = 20


@dataclass
class AppDefaults:
    math: str = ""
    lang: str = ""
    base: str = ""
    label: str = ""
    mgsm_dir: str | None = None
    device: str = "cpu"
    default_lang: str | None = None
    engine: str | None = None  # auto (vLLM when installed), vllm, transformers; None: $LAYERSWAP_ENGINE
    serving: str = "auto"  # vLLM: three engines, or one with weights swapped (auto: by memory)


class App(EvaluateTab):
    def __init__(self, defaults: AppDefaults, workbench: Workbench | None = None):
        self.d = defaults
        self.wb = workbench or Workbench(device=defaults.device, engine=defaults.engine, serving=defaults.serving)
        self.last_eval = None  # the latest EvalReport (shared, like the models)
        self._cancel = threading.Event()

    # ---- helpers --------------------------------------------------------------------------
    def _source(self) -> str | None:
        return self.d.mgsm_dir

    def _langs(self) -> list[tuple[str, str]]:
        src = self._source()
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
            items = mgsm.load(lang, self._source())
        except UserError:
            return []
        return [(f"{it.index}: {it.question[:90]}{'…' if len(it.question) > 90 else ''}", it.index) for it in items]

    def _recipe(self, b, u, tb, tu, transition, tw, non_layer, kind="swap", layer_weights="", k=0, seed=0,
                offset=0, modules="all", method="layer_swap", weight=0.5, lam=1.0, density=0.2,
                drop_rate=0.9, expert_weights="1,1") -> tuple[Plan | None, MethodConfig]:
        r = Recipe.from_values(method=method, b=b, u=u, tb=tb, tu=tu, transition=transition, transition_weight=tw,
                               non_layer=non_layer, kind=kind, layer_weights=layer_weights, k=k, seed=seed, offset=offset,
                               modules=modules, weight=weight, expert_weights=expert_weights, lam=lam, density=density,
                               drop_rate=drop_rate)
        return r.plan, r.method

    def _models_md(self) -> str:
        if not self.wb.report:
            return "No models loaded yet."
        md = self.wb.report.markdown()
        if self.wb.pairing is not None:
            md += ("\n- **warning** " if self.wb.pairing.suspicious else "\n- ") + self.wb.pairing.message()
        if self.wb.engine_note:
            md += f"\n\n**Engine:** {self.wb.engine_note}"
        return md

    def _slider_updates(self, L: int | None):
        if L is None:
            return [gr.update()] * 4
        p = default_plan(L)
        return [gr.update(maximum=L, value=v) for v in (p.b, p.u, p.tb, p.tu)]

    def _analysis_view(self, panels, metric, overlap_metric, k, norm, plan: Plan | None, progress=None):
        """Heatmaps, summary, profile, non-layer table, top table and its CSV for the current controls."""
        p = progress or (lambda f, d: None)
        k = float(k) if k not in (None, "") else 1.0
        an = self.wb.analysis(k, progress=lambda f, d: p(0.9 * f, d))
        note = ""
        if plan is not None:
            try:
                plan.layer_weights(an.num_layers)
            except UserError as e:
                plan, note = None, f"**No plan overlay:** {e}\n\n"
        merged = self.wb.merged_stats(plan) if plan is not None else None
        panels = [x for x in (panels or []) if merged is not None or not x.startswith("merged")]
        heat = analysis_heatmaps(an, panels or ["math", "lang"], metric=metric, overlap_metric=overlap_metric, k=k,
                                 norm=norm, merged=merged, plan=plan)
        prof = layer_profile(an, metric if metric in ("relative", "mean_abs", "topk") else "relative", k, merged, plan,
                             norm)
        nonlayer = _table([format_row(r) for r in an.non_layer_rows(k, merged)])
        ranked = an.most_changed(len(an.tensors) * 2, by=metric, k=k)
        csv_path = Path(tempfile.mkdtemp(prefix="layerswap-")) / f"most-changed-{metric}-k{k:g}.csv"
        write_csv(ranked, csv_path)
        top = _table([format_row(r) for r in ranked[:TOP_ROWS]])
        return heat, note + an.report(k, merged), prof, nonlayer, top, str(csv_path)

    # ---- events ---------------------------------------------------------------------------
    def current(self):
        """Page open: show what the shared workbench holds (no reload)."""
        L = self.wb.num_layers if "math" in self.wb.engines else None
        strip = _strip(self.wb.layer_weights, self.wb.recipe.method, L) if self.wb.recipe is not None else None
        return [self._models_md(), *self._slider_updates(L), strip]

    def load(self, base: str, math: str, lang: str, force: bool = False, progress=gr.Progress()):
        progress(0, desc="reading headers")
        t0 = time.perf_counter()
        try:
            self.wb.load(math.strip(), lang.strip(), base.strip() or None,
                         progress=lambda f, d: progress(f * 0.8, desc=d), force=bool(force))
        except UserError:
            if self.wb.report and not self.wb.report.ok:
                raise UserError("The models cannot be merged:\n" + self.wb.report.summary())
            raise
        heat = None
        if "base" in self.wb.checkpoints:
            progress(0.85, desc="measuring how far each expert moved")
            plan = default_plan(self.wb.num_layers)
            heat = self._analysis_view(DEFAULT_PANELS, "relative", "cosine", 1.0, "raw", plan,
                                       progress=lambda f, d: progress(0.85 + 0.15 * f, desc=d))[0]
        report = self._models_md() + f"\n\nLoaded in {time.perf_counter() - t0:.1f} s."
        return [report, *self._slider_updates(self.wb.num_layers), heat]

    def preview(self, *values):
        """Plan strip for the current controls (no merge)."""
        if "math" not in self.wb.engines:
            return None, "Load models to see the plan."
        L = self.wb.num_layers
        try:
            plan, method = self._recipe(*values)
            lw = plan.layer_weights(L) if method.spec.uses_plan else None
        except UserError as e:
            return None, f"**Invalid plan:** {e}"
        return _strip(lw, method, L), _plan_md(plan, method, L, built=False)

    def build(self, *values, progress=gr.Progress()):
        plan, method = self._recipe(*values)
        progress(0, desc="merging")
        lw = self.wb.build(Recipe(method, plan), progress=lambda f, d: progress(f, desc=d))
        return _strip(lw, method, self.wb.num_layers), _plan_md(plan, method, self.wb.num_layers, built=True)

    def export_yaml(self):
        from ..interop import mergekit_yaml

        if self.wb.recipe is None:
            raise UserError("Build the merge first, then export its mergekit config.")
        text = mergekit_yaml(self.wb.checkpoints["math"], self.wb.checkpoints["lang"], self.wb.recipe,
                             self.wb.checkpoints.get("base"))
        path = Path(tempfile.mkdtemp(prefix="layerswap-")) / "layerswap-mergekit.yml"
        path.write_text(text)
        return gr.update(value=str(path), visible=True)

    def heatmap(self, panels, metric, overlap_metric, k, norm, *plan_values, progress=gr.Progress()):
        """Everything in the 'where each expert changed' section, for the controls and the plan.

        The plan overlay and merged-model panels follow the current layer map; methods without one
        (soup, TIES, ...) get no overlay.
        """
        if "base" not in self.wb.checkpoints:
            raise UserError("The heatmaps compare each expert with the base: load a base model too.")
        plan, method = self._recipe(*plan_values)
        plan = plan if method.spec.uses_plan else None
        heat, summary, prof, nonlayer, top, csv_path = self._analysis_view(
            panels, metric, overlap_metric, k, norm, plan, progress=lambda f, d: progress(f, desc=d))
        return heat, summary, prof, nonlayer, top, gr.update(value=csv_path, visible=True)

    def suggest(self, metric, k):
        """Propose b, u, tb, tu from the analysis and put them on the sliders."""
        if "base" not in self.wb.checkpoints:
            raise UserError("Suggesting a plan needs the analysis against the base: load a base model too.")
        k = float(k) if k not in (None, "") else 1.0
        an = self.wb.analysis(k)
        s = an.suggest_plan(metric if metric in ("relative", "mean_abs", "topk") else "relative", k)
        return [gr.update(value=v) for v in (s.plan.b, s.plan.u, s.plan.tb, s.plan.tu)] + [s.markdown()]

    def questions(self, lang: str):
        choices = self._question_choices(lang)
        return gr.update(choices=choices, value=choices[0][1] if choices else None)

    def ask(self, lang: str, index, free_text: str, max_new_tokens, progress=gr.Progress()):
        if not lang:
            raise UserError("Choose a language.")
        src = self._source()
        progress(0, desc="asking")
        kw = dict(source=src, max_new_tokens=int(max_new_tokens), progress=lambda f, d: progress(f, desc=d))
        if free_text and free_text.strip():
            answers = self.wb.ask_question(free_text, lang, **kw)
        else:
            if index is None:
                raise UserError("Pick a question, or type your own.")
            answers = self.wb.ask_mgsm(lang, int(index), **kw)
        a0 = answers[0]
        head = f"**Prompt** ({a0.engine} engine, greedy, MGSM native CoT)\n\n```\n{a0.prompt}\n```"
        if a0.gold is not None:
            head += f"\n\n**Gold answer: {a0.gold}**"
        return [head] + [_answer_md(a) for a in answers]

    def export(self, out_dir: str, overwrite: bool, progress=gr.Progress()):
        out = (out_dir or "").strip()
        if not out:
            raise UserError("Give an output folder for the merged model.")
        progress(0, desc="writing shards")
        s = self.wb.export(out, overwrite=overwrite, progress=lambda f, d: progress(f, desc=d))
        msg = (f"Wrote `{s.out}`: {s.n_tensors} tensors ({s.n_copied} copied, {s.n_blended} blended), "
               f"{s.bytes_written / 1e6:.1f} MB in {s.shards} shard(s), with config, tokenizer and model card.")
        zip_path = None
        if s.bytes_written <= ZIP_LIMIT_BYTES:
            progress(0.95, desc="zipping for download")
            tmp = Path(tempfile.mkdtemp(prefix="layerswap-"))
            zip_path = shutil.make_archive(str(tmp / Path(s.out).name), "zip", root_dir=s.out)
        else:
            msg += " (too large to offer as a download; copy it from the server.)"
        return msg, gr.update(value=zip_path, visible=zip_path is not None)

    # ---- layout ---------------------------------------------------------------------------
    def blocks(self) -> gr.Blocks:
        d = self.d
        model_q = dict(concurrency_id="models", concurrency_limit=1)
        with gr.Blocks(title="layerswap") as demo:
            gr.Markdown(
                "# layerswap\nMerge a **math expert** and a **language expert** fine-tuned from one base by "
                "layer swapping (Bandarkar et al., ICLR 2025): the bottom *b* and top *u* layers come from the "
                "language expert, the middle from the math expert, with *tb*/*tu* blended transition layers."
            )
            if d.label:
                gr.Markdown(f"> **Default models: {d.label}.**", elem_id="demo-label")
            with gr.Group():
                gr.Markdown("### 1 · Models")
                with gr.Row():
                    base = gr.Textbox(d.base, label="Base model (optional; needed for heatmaps)", elem_id="base")
                    math = gr.Textbox(d.math, label="Math expert (folder or Hub id)", elem_id="math")
                    lang = gr.Textbox(d.lang, label="Language expert (folder or Hub id)", elem_id="lang")
                with gr.Row():
                    force = gr.Checkbox(False, label="Force: load even if the experts seem not to share the base",
                                        scale=3)
                    load_btn = gr.Button("Load", variant="primary", elem_id="load", scale=1)
                report = gr.Markdown("No models loaded yet.", elem_id="report")
            with gr.Tabs(elem_id="main-tabs"):
                with gr.Tab("Build & ask", id="build", elem_id="tab-build"):
                    with gr.Group():
                        gr.Markdown("### 2 · Plan")
                        with gr.Row():
                            b = gr.Slider(0, MAX_SLIDER, 5, step=1, label="b: bottom layers from language expert", elem_id="b")
                            u = gr.Slider(0, MAX_SLIDER, 2, step=1, label="u: top layers from language expert", elem_id="u")
                            tb = gr.Slider(0, MAX_SLIDER, 1, step=1, label="tb: bottom transition layers", elem_id="tb")
                            tu = gr.Slider(0, MAX_SLIDER, 1, step=1, label="tu: top transition layers", elem_id="tu")
                        with gr.Row():
                            transition = gr.Radio(["flat", "ramp"], value="flat", label="Transition weights",
                                                  info="flat: one weight; ramp: linear steps between the experts")
                            tw = gr.Slider(0, 1, 0.5, step=0.05, label="Flat transition weight (language share)")
                            non_layer = gr.Dropdown(list(NON_LAYER_OPTIONS), value="neighbour",
                                                    label="Embeddings, final norm, lm_head",
                                                    info="neighbour: embeddings follow layer 0, norm and lm_head the last layer")
                        with gr.Accordion("Other layer maps (ablations) and baseline methods", open=False):
                            with gr.Row():
                                kind = gr.Radio(list(KINDS), value="swap", label="Layer map",
                                                info="swap uses b/u/tb/tu; middle/random use k; weights uses the list")
                                modules = gr.Radio(list(MODULES), value="all", label="Modules",
                                                   info="apply the map to attention or MLP only")
                            with gr.Row():
                                map_k = gr.Slider(0, MAX_SLIDER, 4, step=1, label="k: layers from the language expert")
                                seed = gr.Number(0, precision=0, label="Seed (random map, DARE)")
                                offset = gr.Radio([0, 1], value=0, label="Alternating: first language layer")
                            layer_weights = gr.Textbox("", label="Per-layer language weights (comma-separated, one per layer)")
                            with gr.Row():
                                method = gr.Dropdown(list(METHODS), value="layer_swap", label="Merge method",
                                                     info="layer_swap uses the map; the others are the paper's baselines",
                                                     elem_id="method")
                                weight = gr.Slider(0, 1, 0.5, step=0.05, label="Soup: language share")
                                lam = gr.Number(1.0, label="Task-vector scale (lambda)")
                                density = gr.Slider(0.01, 1, 0.2, step=0.01, label="TIES density")
                                drop_rate = gr.Slider(0, 0.99, 0.9, step=0.01, label="DARE drop rate")
                        build_btn = gr.Button("Build merge", variant="primary", elem_id="build")
                        strip = gr.Plot(label="Layer sources", elem_id="strip")
                        plan_md = gr.Markdown(elem_id="plan")
                    with gr.Group():
                        gr.Markdown("### 3 · Ask: math expert vs language expert vs merged")
                        lang_choices = self._langs()
                        first_lang = self._default_lang()
                        qchoices = self._question_choices(first_lang)
                        with gr.Row():
                            mlang = gr.Dropdown(lang_choices, value=first_lang, label="MGSM language", elem_id="mgsm-lang")
                            question = gr.Dropdown(qchoices, value=qchoices[0][1] if qchoices else None,
                                                   label="Question from the set", elem_id="question", scale=3,
                                                   info=None if qchoices else "No MGSM data here: start the app with "
                                                   "--mgsm-dir (a folder of mgsm_XX.tsv) or go online; free text works.")
                            max_new = gr.Slider(16, 512, mgsm.MAX_NEW_TOKENS, step=16, label="Max new tokens")
                        free = gr.Textbox(label="…or your own question (overrides the set; prompted in the chosen language's format)",
                                          lines=2, elem_id="free",
                                          placeholder="e.g. Tom has 3 apples. Tom buys 4 more apples. "
                                                      "How many apples does Tom have now?")
                        ask_btn = gr.Button("Ask all three", variant="primary", elem_id="ask")
                        prompt_md = gr.Markdown(elem_id="prompt")
                        with gr.Row():
                            ans = [gr.Markdown(f"**{ROLE_NAMES[r]}**", elem_id=f"answer-{r}") for r in ("math", "lang", "merged")]
                    with gr.Group():
                        gr.Markdown("### 4 · Export")
                        with gr.Row():
                            out_dir = gr.Textbox(str(Path("exports") / "layerswap-merge"), label="Output folder (on the server)",
                                                 scale=3)
                            overwrite = gr.Checkbox(False, label="Overwrite")
                        with gr.Row():
                            export_btn = gr.Button("Export merged model", elem_id="export")
                            yaml_btn = gr.Button("mergekit YAML", elem_id="export-yaml")
                        export_md = gr.Markdown()
                        with gr.Row():
                            download = gr.DownloadButton("Download .zip", visible=False)
                            yaml_file = gr.DownloadButton("Download mergekit YAML", visible=False, elem_id="yaml-file")
                with gr.Tab("Where each expert changed", id="analysis", elem_id="tab-analysis"):
                    with gr.Group():
                        gr.Markdown("### Where each expert changed\nEach cell is one tensor (layer × parameter type); the "
                                    "current plan is drawn on top (outlined: from the language expert, shaded: blended). "
                                    "A reconstruction of the paper's analysis: its exact metric and normalisation are not in "
                                    "its public text, so several are offered.")
                        with gr.Row():
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
                        heat = gr.Plot(label="Change from the base, per layer and parameter type", elem_id="heatmap")
                        summary_md = gr.Markdown(elem_id="analysis-summary")
                        profile = gr.Plot(label="Change by depth", elem_id="profile")
                        with gr.Row():
                            suggest_btn = gr.Button("Suggest plan (sets the sliders)", elem_id="suggest")
                        suggest_md = gr.Markdown(elem_id="suggestion")
                        nonlayer_df = gr.Dataframe(label="Embeddings, final norm, lm_head (outside the layer grid)",
                                                   elem_id="non-layer", interactive=False)
                        top_df = gr.Dataframe(label=f"Most-changed tensors (top {TOP_ROWS} by the chosen metric)",
                                              elem_id="top-table", interactive=False)
                        top_csv = gr.DownloadButton("Download the full ranking (CSV)", visible=False, elem_id="top-csv")
                self._evaluate_tab(model_q)

            plan_inputs = [b, u, tb, tu, transition, tw, non_layer, kind, layer_weights, map_k, seed, offset, modules,
                           method, weight, lam, density, drop_rate]
            view_inputs = [panels, metric, overlap_metric, k, norm, *plan_inputs]
            view_outputs = [heat, summary_md, profile, nonlayer_df, top_df, top_csv]
            view = errors_as_gradio(self.heatmap)
            demo.load(self.current, outputs=[report, b, u, tb, tu, strip], api_visibility="private")
            load_btn.click(errors_as_gradio(self.load), [base, math, lang, force], [report, b, u, tb, tu, heat],
                           api_name="load", **model_q).then(
                _if_base(self, view), view_inputs, view_outputs, api_name="analysis_after_load",
                api_visibility="private", **model_q)
            # preview skips the queue, so a Build queued after it always has the last word
            gr.on([c.change for c in plan_inputs], self.preview, plan_inputs, [strip, plan_md],
                  api_name="preview", trigger_mode="always_last", show_progress="hidden", queue=False)
            build_btn.click(errors_as_gradio(self.build), plan_inputs, [strip, plan_md], api_name="build",
                            **model_q).then(_if_base(self, view), view_inputs, view_outputs,
                                            api_name="analysis_after_build", api_visibility="private", **model_q)
            gr.on([c.change for c in (panels, metric, overlap_metric, k, norm)], view, view_inputs, view_outputs,
                  api_name="heatmap", trigger_mode="always_last", **model_q)
            suggest_btn.click(errors_as_gradio(self.suggest), [metric, k], [b, u, tb, tu, suggest_md],
                              api_name="suggest", **model_q).then(_if_base(self, view), view_inputs, view_outputs,
                                                                  api_name="analysis_after_suggest",
                                                                  api_visibility="private", **model_q)
            mlang.change(self.questions, [mlang], [question], api_name="questions")
            ask_btn.click(errors_as_gradio(self.ask), [mlang, question, free, max_new], [prompt_md, *ans],
                          api_name="ask", **model_q)
            export_btn.click(errors_as_gradio(self.export), [out_dir, overwrite], [export_md, download],
                             api_name="export", **model_q)
            yaml_btn.click(errors_as_gradio(self.export_yaml), None, [yaml_file], api_name="export_yaml")
        return demo


def _if_base(app: "App", fn):
    """Run a follow-up view only when a base is loaded (otherwise leave the section as it is)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "base" not in app.wb.checkpoints:
            return [gr.update()] * 6
        return fn(*args, **kwargs)

    return wrapper


def _table(rows: list[dict]) -> dict:
    """Rows of dicts as the headers + data a gr.Dataframe takes."""
    headers: list[str] = []
    for r in rows:
        headers += [k for k in r if k not in headers]
    return {"headers": headers, "data": [[r.get(h, "") for h in headers] for r in rows]}


def _strip(lw: list[float] | None, method: MethodConfig, L: int):
    """The layer-source strip; methods without a plan touch every layer alike (shown as blends)."""
    return layer_strip(lw if lw is not None else [0.5] * L)


def _plan_md(plan: Plan, method: MethodConfig, L: int, built: bool) -> str:
    state = "**Built.**" if built else "*Preview — not built yet.*"
    if not method.spec.uses_plan:
        return f"{state} {method.describe()} on every tensor ({L} layers). {method.spec.description}"
    lines = plan.describe(L).replace("\n", "  \n")
    return f"{state} {plan.title()} ({L} layers)  \n{lines}"


def _answer_md(a: Answer) -> str:
    s = a.scored
    verdict = ""
    if a.gold is not None:
        verdict = " · **correct**" if s.flexible_correct else " · **wrong**"
    out = s.output.strip() or "(empty)"
    return (f"**{a.model}** · {a.engine} · {a.seconds:.1f}s\n\n```\n{out}\n```\n\n"
            f"strict: `{s.strict}` · flexible: `{s.flexible}`{verdict}")


def create_app(defaults: AppDefaults, workbench: Workbench | None = None, preload: bool = True) -> tuple[gr.Blocks, App]:
    """Build the Blocks app; with `preload`, load the default models before serving."""
    app = App(defaults, workbench)
    if preload and defaults.math and defaults.lang and "math" not in app.wb.engines:
        app.wb.load(defaults.math, defaults.lang, defaults.base or None)
    return app.blocks(), app


os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
