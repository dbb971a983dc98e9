"""The Gradio app. It only calls the library (`Workbench`, `mgsm`, `plots`, `hosting`).

Each browser tab is a `Visitor` (its models and evaluation, in `gr.State`); every event carries the
visitor's own plan controls, so Ask, Export and Evaluate always use that visitor's plan (the
shared merged model is rebuilt when it holds another one). Models are shared between visitors
who use the same trio and run one job at a time (`session.Shared`). The page is served at once;
the default models load behind a visible status, and the current plan is built whenever a tab
needs it. In hosted mode (`layerswap.hosting`) visitors name models by Hub id or preset only,
exports go to the visitor's own folder, and no server path is shown.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import gradio as gr

from .. import mgsm
from ..card import attach_eval
from ..demo import card_markdown
from ..engines import EngineSettings
from ..errors import UserError
from ..hosting import Policy, fetch_models
from ..hub import hub_id_of
from ..methods import METHODS
from ..plans import KINDS, MODULES, NON_LAYER_OPTIONS, Plan, default_plan
from ..recipes import Recipe
from ..presets import Preset, presets
from ..workbench import ROLE_NAMES, Answer, Workbench
from .analysis_tab import AnalysisTab
from .controls import plan_inputs as in_link_order, plan_md, query_string, recipe, restore, strip_figure
from .evaluate import EvaluateTab
from .push import PushSection
from .sweeps_tab import SweepsTab
from .events import guarded
from .session import Shared, Visitor, cancellable, safe_sid, same_recipe

MAX_SLIDER = 64
EXPORT_NAME = "layerswap-merge"


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
    plan: Plan | None = None  # the plan the page opens on (default: the literature's, scaled)
    summary: str = ""  # one line on what the default models show
    policy: Policy = field(default_factory=Policy)
    capacity: int = 1  # model trios held at once
    gpu: str = "cpu"  # cpu, dedicated or zerogpu (`hosting.gpu_mode`)
    tensor_parallel_size: int = 1  # vLLM: GPUs per engine


class App(AnalysisTab, EvaluateTab, PushSection, SweepsTab):
    def __init__(self, defaults: AppDefaults, shared: Shared | None = None):
        self.d = defaults
        self.policy = defaults.policy
        settings = EngineSettings(defaults.engine, defaults.device, defaults.serving,
                                  tensor_parallel_size=defaults.tensor_parallel_size)
        self.shared = shared or Shared(lambda: Workbench.from_settings(settings), defaults.capacity)
        self.presets: dict[str, Preset] = presets()
        self.key = (defaults.base, defaults.math, defaults.lang)
        self.plan0 = defaults.plan or self._default_plan()

    # ---- helpers --------------------------------------------------------------------------
    def event(self, fn):
        """A model-touching event: errors made readable; on ZeroGPU, run where the GPU is attached."""
        if self.d.gpu == "zerogpu":
            import spaces  # the ZeroGPU runtime of Hugging Face Spaces

            fn = spaces.GPU(duration=300)(fn)
        return guarded(fn, self.policy)

    def _default_plan(self) -> Plan:
        """The sliders' first values; a Hub model is not downloaded for them (the page is served first)."""
        from ..checkpoints import Checkpoint

        try:
            return default_plan(Checkpoint.open(self.d.math).num_layers) if self.d.math and not hub_id_of(self.d.math) \
                else Plan()
        except UserError:
            return Plan()

    def visitor(self, v: Visitor | None, request: gr.Request | None) -> Visitor:
        """The tab's own state (API clients that never opened the page get a fresh one)."""
        if v is None:
            v = Visitor(safe_sid(getattr(request, "session_hash", None)), self.key)
        return v

    def fetch(self, refs: tuple[str, str, str], progress, flag) -> None:
        """Hosted mode: Hub models through the size and token checks before anything opens them, whichever
        way they came in (Load, a shared link, models dropped and loaded again). The server's own default
        models are the operator's choice and are not re-checked."""
        if self.policy.hosted and refs != self.key and self.shared.loaded(refs) is None:
            fetch_models(self.policy, refs, refs[0], progress=lambda f, d: progress(f * 0.5, desc=d), cancel=flag)

    def workbench(self, v: Visitor, progress) -> Workbench:
        """The visitor's models, waiting for the background start and loading them again if dropped."""
        flag = self.shared.cancel_flag(v.sid)
        self.fetch(v.refs, progress, flag)
        self.shared.wait_ready(lambda f, d: progress(0, desc=d))
        if v.refs == self.key and self.shared.start_error and self.shared.loaded(v.refs) is None:
            raise UserError(f"The default models did not load ({self.shared.start_error}); load others above.")
        return self.shared.workbench(v.refs, v.force, cancellable(lambda f, d: progress(f, desc=d), flag))

    def built(self, v: Visitor, values, progress) -> tuple[Workbench, Recipe]:
        """The visitor's models with the visitor's plan built into the merged model."""
        wb = self.workbench(v, progress)
        r = recipe(*values)
        r.validate(wb.num_layers)  # against the model, before any work
        flag = self.shared.cancel_flag(v.sid)
        self.shared.ensure_built(wb, r, cancellable(lambda f, d: progress(f, desc=d), flag))
        return wb, r

    def _models_md(self, wb: Workbench | None) -> str:
        if wb is None or not wb.report:
            return "No models loaded yet."
        md = wb.report.markdown()
        if wb.pairing is not None:
            md += ("\n- **warning** " if wb.pairing.suspicious else "\n- ") + wb.pairing.message()
        if wb.engine_note:
            md += f"\n\n**Engine:** {wb.engine_note}"
        return md

    def _strip_and_md(self, wb: Workbench, r: Recipe, built: bool):
        L = wb.num_layers
        return strip_figure(r, L), plan_md(r, L, built)

    # ---- events ---------------------------------------------------------------------------
    def open_page(self, v: Visitor | None, request: gr.Request):
        """Page open: this tab's own state; plan, tab and models restored from the URL if it has them."""
        v = self.visitor(v, request)
        params = dict(request.query_params) if request is not None else {}
        try:
            refs = tuple(self.policy.check_ref(params.get(k, "")) for k in ("base", "math", "lang"))
        except UserError:  # a link naming models this server does not open: the defaults stay
            refs = ("", "", "")
        if refs[1] and refs[2]:
            v.refs = refs  # loaded by the view that follows
        updates, tab = restore(params)
        status = self.shared.status if not self.shared.ready.is_set() else "Models ready."
        return [v, status, *[gr.update(value=r) for r in v.refs], *updates, gr.Tabs(selected=tab or "build")]

    def first_view(self, v: Visitor, *values, progress=gr.Progress()):
        """After the page opened: the models' report and the plan built, once the models are there."""
        wb, r = self.built(v, values, progress)
        sliders = [gr.update(maximum=wb.num_layers)] * 4
        return [v, self._models_md(wb), *self._strip_and_md(wb, r, built=True), query_string(v.refs, values),
                *sliders]

    def load(self, v: Visitor | None, base: str, math: str, lang: str, force: bool = False,
             request: gr.Request = None, progress=gr.Progress()):
        v = self.visitor(v, request)
        refs = (self.policy.check_ref(base, "base"), self.policy.check_ref(math, "math expert"),
                self.policy.check_ref(lang, "language expert"))
        flag = self.shared.cancel_flag(v.sid)
        flag.clear()
        t0 = time.perf_counter()
        self.fetch(refs, progress, flag)
        self.shared.wait_ready(lambda f, d: progress(0, desc=d))
        try:
            wb = self.shared.workbench(refs, bool(force), cancellable(lambda f, d: progress(0.5 + f * 0.5, desc=d), flag))
        except UserError as e:
            raise UserError(f"The models cannot be loaded: {e}") from None
        v.refs, v.force = refs, bool(force)
        report = self._models_md(wb) + f"\n\nLoaded in {time.perf_counter() - t0:.1f} s."
        L = wb.num_layers
        p = self.d.plan if refs == self.key and self.d.plan else default_plan(L)  # the default models' own, else the literature's
        return [v, report] + [gr.update(maximum=L, value=x) for x in (p.b, p.u, p.tb, p.tu)]

    def preview(self, v: Visitor | None, *values):
        """Plan strip for the current controls (no merge); says whether the merged model holds it."""
        wb = self.shared.loaded(v.refs if v else self.key)
        if wb is None or "math" not in wb.checkpoints:
            return gr.update(), "Loading the models…"
        try:
            r = recipe(*values)
            return self._strip_and_md(wb, r, built=same_recipe(wb, r))
        except UserError as e:
            return None, f"**Invalid plan:** {e}"

    def build(self, v: Visitor | None, *values, request: gr.Request = None, progress=gr.Progress()):
        v = self.visitor(v, request)
        self.shared.cancel_flag(v.sid).clear()
        wb, r = self.built(v, values, progress)
        return [v, *self._strip_and_md(wb, r, built=True), query_string(v.refs, values)]

    def questions(self, lang: str):
        choices = self._question_choices(lang)
        return gr.update(choices=choices, value=choices[0][1] if choices else None)

    def ask(self, v: Visitor | None, lang: str, index, free_text: str, max_new_tokens, *values,
            request: gr.Request = None, progress=gr.Progress()):
        """The visitor's plan is built if needed; the three answers appear as each model finishes."""
        v = self.visitor(v, request)
        if not lang:
            raise UserError("Choose a language.")
        free_text = self.policy.check_text(free_text or "", "question")
        self.shared.cancel_flag(v.sid).clear()
        wb, r = self.built(v, values, progress)
        strip, pmd = self._strip_and_md(wb, r, built=True)
        src = self.d.mgsm_dir
        if free_text.strip():
            gold, prompt_lang = None, mgsm.get_language(lang, src)
            prompt = mgsm.build_prompt(free_text.strip(), prompt_lang)
        else:
            if index is None:
                raise UserError("Pick a question, or type your own.")
            items = mgsm.load(lang, src)
            if not 0 <= int(index) < len(items):
                raise UserError(f"MGSM {lang} has questions 0..{len(items) - 1}.")
            item = items[int(index)]
            gold, prompt_lang = item.answer, mgsm.get_language(lang, src)
            prompt = mgsm.build_prompt(item.question, prompt_lang)
        head = f"**Prompt** (greedy, MGSM native CoT; answers from {plan_md(r, wb.num_layers, True, short=True)})"
        head += f"\n\n```\n{prompt}\n```" + (f"\n\n**Gold answer: {gold}**" if gold is not None else "")
        cols = [f"**{ROLE_NAMES[r]}** · answering…" for r in ("math", "lang", "merged")]
        yield [v, head, *cols, strip, pmd]
        for i, role in enumerate(("math", "lang", "merged")):
            with self.shared.lock:  # never held across a yield: the next step may run on another thread
                self.shared.ensure_built(wb, r)  # another visitor may have built in between
                (a,) = wb.ask(prompt, prompt_lang, gold, roles=(role,), max_new_tokens=int(max_new_tokens))
            cols[i] = _answer_md(a)
            yield [v, head, *cols, strip, pmd]

    def export(self, v: Visitor | None, out_dir: str, overwrite: bool, *values, request: gr.Request = None,
               progress=gr.Progress()):
        v = self.visitor(v, request)
        flag = self.shared.cancel_flag(v.sid)
        flag.clear()
        wb = self.workbench(v, progress)
        r = recipe(*values)
        if self.policy.hosted:  # the visitor's own folder, replaced by each export
            out, overwrite = self.shared.folder(v.sid) / EXPORT_NAME, True
        else:
            out = (out_dir or "").strip()
            if not out:
                raise UserError("Give an output folder for the merged model.")
        with self.shared.lock:
            s = wb.export(out, recipe=r, overwrite=overwrite,
                          protect=tuple(p for p in (self.d.mgsm_dir,) if p),
                          progress=cancellable(lambda f, d: progress(f, desc=d), flag))
        v.last_export = str(s.out)
        where = EXPORT_NAME if self.policy.hosted else f"`{s.out}`"
        msg = (f"Wrote {where}: {s.n_tensors} tensors ({s.n_copied} copied, {s.n_blended} computed), "
               f"{s.bytes_written / 1e6:.1f} MB in {s.shards} shard(s), with config, tokenizer and model card.")
        if v.last_eval is not None and v.eval_recipe == r.to_dict():
            attach_eval(s.out, v.last_eval)  # the card shows what was measured on this very merge
            msg += " The card holds your evaluation of this plan (MGSM)."
        cap = self.policy.limits.zip_bytes
        zip_path = None
        if s.bytes_written <= cap:
            progress(0.95, desc="zipping for download")
            zdir = self.shared.folder(v.sid) / "download"
            shutil.rmtree(zdir, ignore_errors=True)
            zdir.mkdir()
            zip_path = shutil.make_archive(str(zdir / EXPORT_NAME), "zip", root_dir=s.out)
        else:
            msg += (f" It is over the {cap / 1e9:.1f} GB download cap: push it to the Hub instead."
                    if self.policy.hosted else " (too large to offer as a download; copy it from the server.)")
        return v, msg, gr.update(value=zip_path, visible=zip_path is not None), gr.update(visible=True)

    def export_yaml(self, v: Visitor | None, *values, request: gr.Request = None, progress=gr.Progress()):
        from ..interop import mergekit_yaml

        v = self.visitor(v, request)
        wb = self.workbench(v, progress)
        text = self.policy.scrub(mergekit_yaml(wb.checkpoints["math"], wb.checkpoints["lang"], recipe(*values),
                                               wb.checkpoints.get("base")))
        path = self.shared.folder(v.sid) / "layerswap-mergekit.yml"
        path.write_text(text)
        return v, gr.update(value=str(path), visible=True)

    def stop(self, v: Visitor | None, request: gr.Request = None):
        v = self.visitor(v, request)
        self.shared.cancel_flag(v.sid).set()
        return "**Stopping** your running job…"

    def pick_preset(self, name: str):
        p = self.presets.get(name)
        if p is None:
            return [gr.update()] * 4
        note = p.note + ("" if p.lang else " **Type a language expert** fine-tuned from this base, then Load.")
        return [gr.update(value=p.base), gr.update(value=p.math), gr.update(value=p.lang), note]

    def start_loading(self) -> None:
        """Load the default models (and build the opening plan) behind the served page."""
        if self.d.math and self.d.lang:
            self.shared.start_background(self.key, after=lambda wb: self.shared.ensure_built(
                wb, Recipe(plan=self.d.plan or default_plan(wb.num_layers))))
        else:
            self.shared.status = "No default models: load some above."
            self.shared.ready.set()

    def end(self, request: gr.Request):
        self.shared.end(safe_sid(request.session_hash))

    # ---- layout ---------------------------------------------------------------------------
    def blocks(self) -> gr.Blocks:
        d, pol = self.d, self.policy
        lane = dict(concurrency_id="models", concurrency_limit=1)
        p0 = self.plan0
        with gr.Blocks(title="layerswap", delete_cache=(3600, 3600)) as demo:
            visitor = gr.State(None)
            gr.Markdown(
                "# layerswap\nMerge a **math expert** and a **language expert** fine-tuned from one base by "
                "layer swapping (Bandarkar et al., ICLR 2025): the bottom *b* and top *u* layers come from the "
                "language expert, the middle from the math expert, with *tb*/*tu* blended transition layers."
            )
            if d.label:
                gr.Markdown(f"> **Default models: {d.label}.**" + (f" {d.summary}" if d.summary else ""),
                            elem_id="demo-label")
            if d.summary:
                with gr.Accordion("The demo organism's card: how it was built, every number, its limits",
                                  open=False, elem_id="organism-card"):
                    gr.Markdown(card_markdown(), elem_id="card-text")
            if pol.hosted:
                gr.Markdown(f"> **Hosted mode** ({d.gpu} GPU mode):  models by Hub id (public, no token) or preset only; exports stay "
                            f"in your own temporary folder. Limits: {pol.limits.markdown()}.", elem_id="hosted")
            status = gr.Markdown(self.shared.status, elem_id="status")
            with gr.Group():
                gr.Markdown("### 1 · Models")
                with gr.Row():
                    preset = gr.Dropdown([(p.label, k) for k, p in self.presets.items()], value=None,
                                         label="Presets", elem_id="preset", scale=3)
                    preset_md = gr.Markdown(elem_id="preset-note")
                src = "Hub id" if pol.hosted else "folder or Hub id"
                with gr.Row():
                    base = gr.Textbox(d.base, label="Base model (optional; needed for heatmaps)", elem_id="base")
                    math = gr.Textbox(d.math, label=f"Math expert ({src})", elem_id="math")
                    lang = gr.Textbox(d.lang, label=f"Language expert ({src})", elem_id="lang")
                with gr.Row():
                    force = gr.Checkbox(False, label="Force: load even if the experts seem not to share the base",
                                        scale=3)
                    load_btn = gr.Button("Load", variant="primary", elem_id="load", scale=1)
                    stop_btn = gr.Button("Stop my job", variant="stop", elem_id="stop", scale=1)
                report = gr.Markdown("Loading the default models…", elem_id="report")
            with gr.Tabs(elem_id="main-tabs") as tabs:
                with gr.Tab("Build & ask", id="build", elem_id="tab-build"):
                    with gr.Group():
                        gr.Markdown("### 2 · Plan (built automatically when you ask, evaluate or analyse)")
                        with gr.Row():
                            b = gr.Slider(0, MAX_SLIDER, p0.b, step=1, label="b: bottom layers from language expert", elem_id="b")
                            u = gr.Slider(0, MAX_SLIDER, p0.u, step=1, label="u: top layers from language expert", elem_id="u")
                            tb = gr.Slider(0, MAX_SLIDER, p0.tb, step=1, label="tb: bottom transition layers", elem_id="tb")
                            tu = gr.Slider(0, MAX_SLIDER, p0.tu, step=1, label="tu: top transition layers", elem_id="tu")
                        with gr.Row():
                            transition = gr.Radio(["flat", "ramp"], value=p0.transition, label="Transition weights",
                                                  info="flat: one weight; ramp: linear steps between the experts",
                                                  elem_id="transition")
                            tw = gr.Slider(0, 1, p0.transition_weight, step=0.05,
                                           label="Flat transition weight (language share)", elem_id="tw")
                            non_layer = gr.Dropdown(list(NON_LAYER_OPTIONS), value=p0.non_layer,
                                                    label="Embeddings, final norm, lm_head", elem_id="non-layer-src",
                                                    info="neighbour: embeddings follow layer 0, norm and lm_head the last layer")
                        with gr.Accordion("Other layer maps (ablations) and baseline methods", open=False):
                            with gr.Row():
                                kind = gr.Radio(list(KINDS), value="swap", label="Layer map", elem_id="kind",
                                                info="swap uses b/u/tb/tu; middle/random use k; weights uses the list")
                                modules = gr.Radio(list(MODULES), value="all", label="Modules", elem_id="modules",
                                                   info="apply the map to attention or MLP only")
                            with gr.Row():
                                map_k = gr.Slider(0, MAX_SLIDER, 4, step=1, label="k: layers from the language expert")
                                seed = gr.Number(0, precision=0, label="Seed (random map, DARE)")
                                offset = gr.Radio([0, 1], value=0, label="Alternating: first language layer")
                            with gr.Row():
                                layer_weights = gr.Textbox("", label="Per-layer language weights (comma-separated, one per layer)")
                                revert = gr.Textbox("", label="Revert layers to the base (e.g. 3-4,7; needs the base)",
                                                    info="their fine-tuning undone: every tensor from the base", elem_id="revert")
                            with gr.Row():
                                method = gr.Dropdown(list(METHODS), value="layer_swap", label="Merge method",
                                                     info="layer_swap uses the map; the others are the paper's baselines",
                                                     elem_id="method")
                                weight = gr.Slider(0, 1, 0.5, step=0.05, label="Soup: language share")
                                lam = gr.Number(1.0, label="Task-vector scale (lambda)")
                                density = gr.Slider(0.01, 1, 0.2, step=0.01, label="TIES density")
                                drop_rate = gr.Slider(0, 0.99, 0.9, step=0.01, label="DARE drop rate")
                                expert_weights = gr.Textbox("1,1", label="Task arithmetic: expert weights (math, language)")
                        with gr.Row():
                            build_btn = gr.Button("Build merge now", variant="primary", elem_id="build")
                            share = gr.Textbox(label="Share this view (append to the page address)", elem_id="share",
                                               interactive=False, buttons=["copy"], scale=3)
                        strip = gr.Plot(label="Layer sources", elem_id="strip")
                        plan_out = gr.Markdown(elem_id="plan")
                    with gr.Group():
                        gr.Markdown("### 3 · Ask: math expert vs language expert vs merged")
                        first_lang = self._default_lang()
                        qchoices = self._question_choices(first_lang)
                        with gr.Row():
                            mlang = gr.Dropdown(self._langs(), value=first_lang, label="MGSM language", elem_id="mgsm-lang")
                            question = gr.Dropdown(qchoices, value=qchoices[0][1] if qchoices else None,
                                                   label="Question from the set", elem_id="question", scale=3,
                                                   info=None if qchoices else "No MGSM data here: start the app with "
                                                   "--mgsm-dir (a folder of mgsm_XX.tsv) or go online; free text works.")
                            max_new = gr.Slider(16, 512, mgsm.MAX_NEW_TOKENS, step=16, label="Max new tokens")
                        free = gr.Textbox(label="…or your own question (overrides the set; prompted in the chosen language's format)",
                                          lines=2, elem_id="free", max_length=pol.limits.text_chars if pol.hosted else None,
                                          placeholder="e.g. Tom has 3 apples. Tom buys 4 more apples. "
                                                      "How many apples does Tom have now?")
                        ask_btn = gr.Button("Ask all three", variant="primary", elem_id="ask")
                        prompt_md = gr.Markdown(elem_id="prompt")
                        with gr.Row():
                            ans = [gr.Markdown(f"**{ROLE_NAMES[r]}**", elem_id=f"answer-{r}") for r in ("math", "lang", "merged")]
                    with gr.Group():
                        gr.Markdown("### 4 · Export")
                        with gr.Row():
                            out_dir = gr.Textbox(str(Path("exports") / EXPORT_NAME), label="Output folder (on the server)",
                                                 scale=3, visible=not pol.hosted, elem_id="out-dir")
                            overwrite = gr.Checkbox(False, label="Overwrite an earlier export", visible=not pol.hosted)
                        with gr.Row():
                            export_btn = gr.Button("Export merged model", elem_id="export")
                            yaml_btn = gr.Button("mergekit YAML", elem_id="export-yaml")
                        export_md = gr.Markdown(elem_id="export-status")
                        with gr.Row():
                            download = gr.DownloadButton("Download .zip", visible=False, elem_id="download")
                            yaml_file = gr.DownloadButton("Download mergekit YAML", visible=False, elem_id="yaml-file")
                    push_group, push_inputs, push_btn, push_status = self._push_section()
                analysis_io = self._analysis_tab()
                eval_io = self._evaluate_tab()
                sweeps_io = self._sweeps_tab()

            plan_inputs = in_link_order(b=b, u=u, tb=tb, tu=tu, transition=transition, tw=tw, non_layer=non_layer, kind=kind,
                                        weights=layer_weights, k=map_k, seed=seed, offset=offset, modules=modules,
                                        method=method, weight=weight, lam=lam, density=density, drop_rate=drop_rate,
                                        expert_weights=expert_weights, revert=revert)
            refs = [base, math, lang]
            on = dict(show_progress_on=[status])
            opened = demo.load(self.open_page, [visitor], [visitor, status, *refs, *plan_inputs, tabs],
                               api_visibility="private", queue=False)
            opened.then(self.event(self.first_view), [visitor, *plan_inputs],
                        [visitor, report, strip, plan_out, share, b, u, tb, tu], api_visibility="private", **lane, **on).then(
                self.event(self.view), [visitor, *analysis_io.inputs, *plan_inputs], analysis_io.outputs,
                api_visibility="private", **lane, **on).then(
                lambda: "Models ready.", None, [status], queue=False, api_visibility="private")
            demo.unload(self.end)
            preset.change(self.pick_preset, [preset], [*refs, preset_md], api_name="preset", queue=False)
            load_btn.click(self.event(self.load), [visitor, *refs, force], [visitor, report, b, u, tb, tu],
                           api_name="load", **lane, **on).then(
                self.event(self.first_view), [visitor, *plan_inputs], [visitor, report, strip, plan_out, share, b, u, tb, tu],
                api_visibility="private", **lane, **on).then(
                self.event(self.view), [visitor, *analysis_io.inputs, *plan_inputs], analysis_io.outputs,
                api_visibility="private", **lane, **on)
            stop_btn.click(self.stop, [visitor], [status], api_name="stop", queue=False)
            # preview skips the queue, so a Build queued after it always has the last word
            gr.on([c.change for c in plan_inputs], self.preview, [visitor, *plan_inputs], [strip, plan_out],
                  api_name="preview", trigger_mode="always_last", show_progress="hidden", queue=False)
            build_btn.click(self.event(self.build), [visitor, *plan_inputs], [visitor, strip, plan_out, share],
                            api_name="build", **lane, **on).then(
                self.event(self.view), [visitor, *analysis_io.inputs, *plan_inputs], analysis_io.outputs,
                api_visibility="private", **lane, **on)
            mlang.change(self.questions, [mlang], [question], api_name="questions")
            ask_btn.click(self.event(self.ask), [visitor, mlang, question, free, max_new, *plan_inputs],
                          [visitor, prompt_md, *ans, strip, plan_out], api_name="ask", **lane, **on)
            export_btn.click(self.event(self.export), [visitor, out_dir, overwrite, *plan_inputs],
                             [visitor, export_md, download, push_group], api_name="export", **lane, **on)
            self._wire_push(visitor, push_inputs, push_btn, push_status, lane)
            yaml_btn.click(self.event(self.export_yaml), [visitor, *plan_inputs], [visitor, yaml_file],
                           api_name="export_yaml", **lane, **on)
            self._wire_analysis(analysis_io, visitor, plan_inputs, [b, u, tb, tu], lane, on)
            self._wire_evaluate(eval_io, visitor, plan_inputs, lane, on)
            self._wire_sweeps(sweeps_io, visitor, lane)
        return demo


def _answer_md(a: Answer) -> str:
    s = a.scored
    verdict = "" if a.gold is None else " · **correct**" if s.flexible_correct else " · **wrong**"
    out = s.output.strip() or "(empty)"
    return (f"**{a.model}** · {a.engine} · {a.seconds:.1f}s\n\n```\n{out}\n```\n\n"
            f"strict: `{s.strict}` · flexible: `{s.flexible}`{verdict}")


def create_app(defaults: AppDefaults, shared: Shared | None = None) -> tuple[gr.Blocks, App]:
    """Build the Blocks app; `App.start_loading` then loads the default models in the background."""
    app = App(defaults, shared)
    return app.blocks(), app


os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
