"""What every part of the page shares: the app's defaults, the hosting policy, the shared models, and `job`.

`Context.job(handler)` is how a tab wires a handler ``handler(ctx, job, *values)``: Gradio fills in the
request, the caller's visitor comes from the server's session, its Stop flag is cleared, `job.progress`
is cancellable, errors become readable dialogs (`ui.events`). `Context.lane` is the one queue lane that
model-touching events share. `Page` holds the components that more than one part of the page uses.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import mgsm
from ..engines import EngineSettings
from ..errors import UserError
from ..hosting import Policy, fetch_models
from ..hub import hub_id_of
from ..plans import Plan, default_plan
from ..presets import Preset, presets
from ..recipes import Recipe
from ..workbench import Workbench
from ..fields import LINK_KEYS
from .controls import plan_md, recipe, strip_figure
from .events import Job, event
from .session import Shared


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


@dataclass
class Page:
    """Components more than one part of the page reads or writes (filled in as the page is laid out)."""

    status: Any = None
    report: Any = None
    refs: list = field(default_factory=list)  # base, math, lang
    plan: list = field(default_factory=list)  # the plan controls, in `fields.LINK_KEYS` order
    sliders: list = field(default_factory=list)  # b, u, tb, tu
    strip: Any = None
    plan_md: Any = None
    share: Any = None
    tabs: Any = None
    push_group: Any = None
    _redraw: Callable | None = None  # set by the analysis tab: `dep.then(its view)`
    _pending: list = field(default_factory=list)

    def redraw(self, dep):
        """Redraw the analysis tab after event `dep` (wired once the tab exists); the `.then` is returned."""
        if self._redraw is None:
            self._pending.append(dep)
            return dep
        return self._redraw(dep)

    def set_redraw(self, then: Callable) -> None:
        self._redraw = then
        for dep in self._pending:
            then(dep)
        self._pending.clear()

    @property
    def on(self) -> dict:
        """Where a model-touching event shows its progress: the status line under the title."""
        return dict(show_progress_on=[self.status])


class Context:
    def __init__(self, defaults: AppDefaults, shared: Shared | None = None):
        self.d = defaults
        self.policy = defaults.policy
        settings = EngineSettings(defaults.engine, defaults.device, defaults.serving,
                                  tensor_parallel_size=defaults.tensor_parallel_size)
        self.shared = shared or Shared(lambda: Workbench.from_settings(settings), defaults.capacity)
        self.presets: dict[str, Preset] = presets()
        self.key = (defaults.base, defaults.math, defaults.lang)
        self.plan0 = defaults.plan or self._default_plan()
        self.lane = dict(concurrency_id="models", concurrency_limit=1)  # model-touching events: one at a time

    def job(self, handler: Callable, *, gpu: bool = True, clear_stop: bool = True, plan: bool = False) -> Callable:
        """`handler(ctx, job, *values)` as a Gradio event (see the module's docstring). `gpu`: on ZeroGPU it
        runs where the GPU is attached; `clear_stop`: False for the Stop buttons and quick reads; `plan`: its
        ``*values`` are the plan controls (named after `fields.LINK_KEYS` in the API)."""
        wrap = None
        if gpu and self.d.gpu == "zerogpu":
            import spaces  # the ZeroGPU runtime of Hugging Face Spaces

            wrap = spaces.GPU(duration=300)
        return event(functools.partial(handler, self), lambda session: self.shared.visitor(session, self.key),
                     self.policy, clear_stop=clear_stop, wrap=wrap, rest=LINK_KEYS if plan else ())

    def _default_plan(self) -> Plan:
        """The sliders' first values; a Hub model is not downloaded for them (the page is served first)."""
        from ..checkpoints import Checkpoint

        try:
            return default_plan(Checkpoint.open(self.d.math).num_layers) if self.d.math and not hub_id_of(self.d.math) \
                else Plan()
        except UserError:
            return Plan()

    # ---- the visitor's models ----------------------------------------------------------------
    def fetch(self, refs: tuple[str, str, str], job: Job) -> None:
        """Hosted mode: Hub models through the size and token checks before anything opens them, whichever
        way they came in (Load, a shared link, models dropped and loaded again). The server's own default
        models are the operator's choice and are not re-checked."""
        if self.policy.hosted and refs != self.key and self.shared.loaded(refs) is None:
            fetch_models(self.policy, refs, refs[0], progress=job.part(0, 0.5), cancel=job.visitor.stop)

    def workbench(self, job: Job) -> Workbench:
        """The visitor's models, waiting for the background start and loading them again if dropped."""
        v = job.visitor
        self.fetch(v.refs, job)
        self.shared.wait_ready(lambda f, d: job.progress(0, d))
        if v.refs == self.key and self.shared.start_error and self.shared.loaded(v.refs) is None:
            raise UserError(f"The default models did not load ({self.shared.start_error}); load others above.")
        return self.shared.workbench(v.refs, v.force, job.progress)

    def built(self, job: Job, values) -> tuple[Workbench, Recipe]:
        """The visitor's models answering, with the visitor's plan built into the merged model."""
        wb = self.workbench(job)
        r = recipe(*values)
        r.validate(wb.num_layers)  # against the model, before any work
        self.shared.engines(job.visitor.refs, job.progress)
        self.shared.ensure_built(wb, r, job.progress)
        return wb, r

    def models_md(self, wb: Workbench | None) -> str:
        if wb is None or not wb.report:
            return "No models loaded yet."
        md = wb.report.markdown()
        if wb.pairing is not None:
            md += ("\n- **warning** " if wb.pairing.suspicious else "\n- ") + wb.pairing.message()
        if wb.engine_plan is not None:
            md += f"\n\n{wb.engine_plan.describe()}"
        now = self.shared.engine_status(wb)
        if now:
            md += f"\n\n**Engine now:** {now}"
        return md

    def strip_and_md(self, wb: Workbench, r: Recipe, built: bool):
        L = wb.num_layers
        return strip_figure(r, L), plan_md(r, L, built)

    def start_loading(self) -> None:
        """Load the default models (and build the opening plan) behind the served page."""
        if self.d.math and self.d.lang:
            self.shared.start_background(self.key, after=lambda wb: self.shared.ensure_built(
                wb, Recipe(plan=self.d.plan or default_plan(wb.num_layers))))
        else:
            self.shared.status = "No default models: load some above."
            self.shared.ready.set()

    # ---- the MGSM data the page offers (Ask, Evaluate) -----------------------------------------
    def langs(self) -> list[tuple[str, str]]:
        src = self.d.mgsm_dir
        langs = mgsm.languages(src)
        return [(f"{langs[c].name} ({c})", c) for c in mgsm.available_languages(src) if c in langs]

    def default_lang(self) -> str | None:
        codes = [c for _, c in self.langs()]
        for c in (self.d.default_lang, "xx", "sw", "en"):
            if c in codes:
                return c
        return codes[0] if codes else None

    def question_choices(self, lang: str | None) -> list[tuple[str, int]]:
        if not lang:
            return []
        try:
            items = mgsm.load(lang, self.d.mgsm_dir)
        except UserError:
            return []
        return [(f"{it.index}: {it.question[:90]}{'…' if len(it.question) > 90 else ''}", it.index) for it in items]

    def counts(self) -> dict[str, int]:
        """Questions per language in the data folder (what "0 = all" means)."""
        out = {}
        for _, c in self.langs():
            try:
                out[c] = len(mgsm.load(c, self.d.mgsm_dir))
            except UserError:
                pass
        return out
