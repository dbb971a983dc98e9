"""What every part of the page shares: the app's defaults, the hosting policy, the shared models, and `job`.

`Context.job(handler)` is how a tab wires a handler ``handler(ctx, job, *values)``: Gradio fills in the
request, the caller's visitor comes from the server's session, its Stop flag is cleared, `job.progress`
is cancellable, errors become readable dialogs (`ui.events`). With ``plan=True`` the handler's last parameter
is the plan controls read once (`controls.PlanControls`: the event's one `Recipe`), never their raw values.
`Context.lane` is the one queue lane that model-touching events share. `Page` holds the components that more
than one part of the page uses.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from layerswap.evaluation import mgsm
from layerswap.engines import EngineSettings
from layerswap.core.errors import UserError
from layerswap.serving.hosting import Policy, fetch_models, prune_hub_cache
from layerswap.models.hub import hub_id_of
from layerswap.core.markup import code
from layerswap.shipped.organisms import describe, opening_plan, showcase, test_set
from layerswap.recipe.plans import Plan
from layerswap.models.presets import Preset, portable_ref, presets
from layerswap.recipe.recipes import Recipe
from layerswap.serving.workbench import Workbench
from layerswap.recipe.fields import LINK_KEYS
from layerswap.ui.controls import PlanControls, plan_md, read_plan, strip_figure
from layerswap.ui.events import Job, event, page_words
from layerswap.ui.lane import Lane
from layerswap.ui.files import neutral_root
from layerswap.ui.session import Shared
from layerswap.ui.visitors import MAX_VISITORS


@dataclass
class AppDefaults:
    math: str = ""
    lang: str = ""
    base: str = ""
    label: str = ""
    mgsm_dir: str | None = None
    default_lang: str | None = None
    engine: EngineSettings = field(default_factory=lambda: EngineSettings(device="cpu"))  # the app's engine flags
    plan: Plan | None = None  # the plan the page opens on (default: `organisms.opening_plan`)
    policy: Policy = field(default_factory=Policy)
    capacity: int = 1  # model trios held at once
    gpu: str = "cpu"  # cpu or dedicated (`hosting.gpu_mode`; on ZeroGPU answers are off)
    max_visitors: int = MAX_VISITORS  # sessions remembered at once (`ui.visitors`)


@dataclass
class Page:
    """Components more than one part of the page reads or writes (filled in as the page is laid out)."""

    status: Any = None
    report: Any = None
    refs: list = field(default_factory=list)  # base, math, lang
    models: Any = None  # hidden: the models this page shows (`events.page_models`), sent back by model-using jobs
    plan: list = field(default_factory=list)  # the plan controls, in `fields.LINK_KEYS` order
    sliders: list = field(default_factory=list)  # b, u, tb, tu
    strip: Any = None
    plan_md: Any = None
    share: Any = None
    link: dict = field(default_factory=dict)  # the share link's event (`models.wire`): chained after what changes it
    family: Any = None  # the family's CODE=REF lines (`ui.family`)
    family_plans: Any = None  # its per-language plans, CODE=b,u,tb,tu lines (`controls.own_plans`)
    family_lang: Any = None  # the analysis tab's language menu (`ui.family_views.menu`)
    tabs: Any = None
    push_group: Any = None
    tab: Any = None  # the visitor's open tab (a gr.State), for the share link
    tab_items: dict = field(default_factory=dict)  # tab id -> gr.Tab
    views: list = field(default_factory=list)  # (components, fn(ctx, refs) -> their updates): what belongs to models
    view_outputs: list = field(default_factory=list)  # the components of `views`, in order
    _redraw: Callable | None = None  # set by the analysis tab: `dep.then(its view)`
    _pending: list = field(default_factory=list)

    def on_models(self, components: list, fn: Callable) -> None:
        """`fn(ctx, refs)` gives `components`' updates for the visitor's models (menus, banner...): set when the page
        opens on other models than the defaults and on every Load (`ui.tabs.models`)."""
        self.views.append((components, fn))

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
        self.shared = shared or Shared(lambda: Workbench.from_settings(defaults.engine), defaults.capacity,
                                       defaults.max_visitors, neutral_root() if self.policy.hosted else None)
        self.presets: dict[str, Preset] = presets()
        self.key = (defaults.base, defaults.math, defaults.lang)
        self.plan0 = defaults.plan or self._opening_plan()
        self.fair = Lane(self.policy.hosted, lambda session: self.shared.visitor(session, self.key))
        self.shared.visitors.alive = lambda v: self.fair.alive(v.job, v.session) or self.fair.pending(v.session)
        # model-touching events: one at a time, each visitor's one job admitted as it joins the queue
        # hosted mode: admitted as they join the queue (Gradio's validator; it also checks the values there, so a
        # wrong one is refused before queueing, with the message in the reply's body rather than as an event)
        admit = dict(validator=self.fair.admit) if self.policy.hosted else {}
        self.lane = dict(concurrency_id="models", concurrency_limit=1, **admit)
        # the page's first view reads loaded models' headers: beside the lane, so a long job never delays it
        self.views = dict(concurrency_id="views", concurrency_limit=4, **admit)

    def job(self, handler: Callable, *, clear_stop: bool = True, plan: bool = False,
            models: bool | str = False) -> Callable:
        """`handler(ctx, job, *values)` as a Gradio event (see the module's docstring). `clear_stop`: False for the
        Stop buttons and quick reads (the others are heavy: they run in the lane, `Context.lane`, one per visitor in
        hosted mode); `plan`: its last parameter takes the plan controls (named after `fields.LINK_KEYS` in the API),
        read once into `PlanControls` (`controls.read_plan`);
        `models`: its last input is `Page.models` (the models the page shows), and the job is refused when they are
        not the visitor's (``"redraw"``: a redraw chained after another event, dropped without a dialog: it was
        queued before a Load changed the models, and the Load redraws for the new ones)."""
        return event(functools.partial(handler, self), lambda session: self.shared.visitor(session, self.key),
                     self.policy, clear_stop=clear_stop, rest=LINK_KEYS if plan else (), read=read_plan,
                     lane=self.fair if clear_stop else None, release=self.shared.visitors.release, models=models)

    def _opening_plan(self) -> Plan:
        """The sliders' first values (`organisms.opening_plan`); a Hub model is not downloaded for them (the page is
        served first)."""
        from layerswap.models.checkpoints import Checkpoint

        try:
            return opening_plan(self.key, Checkpoint.open(self.d.math).num_layers).plan \
                if self.d.math and not hub_id_of(self.d.math) else Plan()
        except UserError:
            return Plan()

    # ---- the visitor's models ----------------------------------------------------------------
    def fetch(self, refs: tuple[str, str, str], job: Job) -> None:
        """Hosted mode: Hub models through the size and token checks before anything opens them, whichever
        way they came in (Load, a shared link, models dropped and loaded again). The server's own default
        models are the operator's choice and are not re-checked."""
        if self.policy.hosted and refs != self.key and self.shared.loaded(refs) is None:
            fetch_models(self.policy, refs, refs[0], progress=job.part(0, 0.5), cancel=job.visitor.stop)
            in_use = {hub_id_of(r) for key in [refs, *self.shared.loaded_keys()] for r in key if r}
            prune_hub_cache(self.policy.limits.hub_cache_bytes, {r for r in in_use if r})

    def workbench(self, job: Job) -> Workbench:
        """The visitor's models, waiting for the background start and loading them again if dropped."""
        v = job.visitor
        self.fetch(v.refs, job)
        self.shared.wait_ready(lambda f, d: job.progress(0, d))
        if v.refs == self.key and self.shared.start_error and self.shared.loaded(v.refs) is None:
            raise UserError(f"The default models did not load ({self.shared.start_error}); load others above.")
        return self.shared.workbench(v.refs, v.force, job.progress)

    def built(self, job: Job, controls: PlanControls) -> tuple[Workbench, Recipe]:
        """The visitor's models answering, with the event's recipe (`controls.recipe`) built into the merged model."""
        wb = self.workbench(job)
        r = controls.recipe
        controls.sources(wb.num_layers)  # against the model, before any work (the page's views reuse it)
        self.shared.engines(job.visitor.refs, job.progress)
        self.shared.ensure_built(wb, r, job.progress)
        return wb, r

    def models_md(self, wb: Workbench | None) -> str:
        if wb is None or not wb.report:
            return "No models loaded yet."
        md = wb.report.markdown()
        if wb.pairing is not None:
            md += ("\n- **warning** " if wb.pairing.suspicious else "\n- ") + page_words(wb.pairing.message())
        if wb.engine_plan is not None:
            md += f"\n\n{wb.engine_plan.describe()}"
            if wb.engine_plan.transformers_first and wb.engine_plan.engine == "vllm":  # the plan is not what answers first
                md += (" Until they have started (about a minute the first time), transformers answers: **Engine now** "
                       "below says which engines answer.")
        if wb.engine_plan is not None and {"math", "lang"} <= set(wb.checkpoints):
            from layerswap.engines.planning import hardware_table, table_markdown
            from layerswap.core.hardware import FLAVOURS

            rows = hardware_table(wb.checkpoints, list(FLAVOURS), engine=wb.engine_choice, settings=wb.vllm_settings)
            md += ("\n\n<details><summary>What would serve these models (Hugging Face Spaces hardware)</summary>\n\n"
                   + table_markdown(rows) + "\n\n</details>")
        return md

    def strip_and_md(self, wb: Workbench, controls: PlanControls, built: bool):
        """The strip and the plan text of the event's recipe, from its one `Sources` (validated against the model)."""
        src = controls.sources(wb.num_layers)
        return strip_figure(src), plan_md(src, built)

    def start_loading(self) -> None:
        """Load the default models (and build the opening plan) behind the served page."""
        if self.d.math and self.d.lang:
            self.shared.start_background(self.key, after=lambda wb: self.shared.ensure_built(
                wb, Recipe(plan=self.d.plan or opening_plan(self.key, wb.num_layers).plan)))
        else:
            self.shared.status = "No default models: load some above."
            self.shared.ready.set()

    # ---- what belongs to the visitor's models: their MGSM set, the menus, the banner ---------------------
    def adapter_kind(self, refs: tuple[str, str, str]) -> str | None:
        """The PEFT kind both experts are (``lora``, ``ia3``, ``prefix``), else None (full models, a mixed pair): what
        "Export as PEFT adapter" needs. From the loaded models, else from local folders' files (a Hub id's kind is
        known once it is loaded)."""
        wb = self.shared.loaded(refs)
        cks = wb.checkpoints if wb is not None else {}
        if {"math", "lang"} <= set(cks):
            kinds = {cks[r].adapter_kind for r in ("math", "lang")}
        else:
            kinds = {_local_kind(r) for r in refs[1:]}
        return kinds.pop() if len(kinds) == 1 else None

    def data(self, refs: tuple[str, str, str]) -> str | None:
        """The MGSM set the models are tested on: the set they bring (`organisms.test_set`: a shipped organism's),
        else the app's (--mgsm-dir, $LAYERSWAP_MGSM_DIR), else None (the Hub)."""
        own = test_set(refs[1], refs[2], refs[0])
        return str(own) if own is not None else self.d.mgsm_dir

    def langs(self, refs: tuple[str, str, str]) -> list[tuple[str, str]]:
        src = self.data(refs)
        langs = mgsm.languages(src)
        return [(f"{langs[c].name} ({c})", c) for c in mgsm.available_languages(src) if c in langs]

    def opening_question(self, refs: tuple[str, str, str]) -> tuple[str | None, int]:
        """The language and question Ask opens on: one a shipped pair's recommended plan answers right
        (`organisms.showcase`), else question 0 of the app's --default-lang, Swahili or the first target."""
        codes = [c for _, c in self.langs(refs)]
        shown = showcase(refs)
        if shown is not None and shown[0] in codes:
            return shown
        first = next((c for c in (self.d.default_lang, "sw") if c in codes), None)
        return first or next((c for c in codes if c != "en"), codes[0] if codes else None), 0

    def question_choices(self, lang: str | None, refs: tuple[str, str, str]) -> list[tuple[str, int]]:
        if not lang:
            return []
        try:
            items = mgsm.load(lang, self.data(refs))
        except UserError:
            return []
        return [(f"{it.index}: {it.question[:90]}{'…' if len(it.question) > 90 else ''}", it.index) for it in items]

    def counts(self, refs: tuple[str, str, str]) -> dict[str, int]:
        """Questions per language in the models' set (what "0 = all" means)."""
        out = {}
        for _, c in self.langs(refs):
            try:
                out[c] = len(mgsm.load(c, self.data(refs)))
            except UserError:
                pass
        return out

    def test_set_md(self, refs: tuple[str, str, str]) -> str:
        """Which test set the page uses for these models, and what it holds."""
        src, langs, counts = self.data(refs), self.langs(refs), self.counts(refs)
        where = f"MGSM set {code(portable_ref(src))}" if src else f"MGSM from the Hub dataset {code(mgsm.HUB_DATASET)}"
        own = " (the one these models bring)" if test_set(refs[1], refs[2], refs[0]) is not None else ""
        sizes = sorted(set(counts.values()))
        n = f"; {sizes[0]:,} questions each" if len(sizes) == 1 else ""
        return f"**Test set:** {where}{own}: {', '.join(label for label, _ in langs) or 'no languages'}{n}."

    def banner(self, refs: tuple[str, str, str]) -> tuple[str, Any]:
        """The line above the page naming the models (a preset's label, a shipped pair's measured summary) and
        the folder of the organism card that belongs to them (None: no card)."""
        d = describe(refs)
        label = (self.d.label if refs == self.key else "") or d.label  # the operator's, else the preset's
        if label:
            md = f"> **Models: {label}.**" + (f" {d.summary}" if d.summary else "")
        else:
            md = f"> **Models:** math expert {code(refs[1])}, language expert {code(refs[2])}" + \
                (f", base {code(refs[0])}." if refs[0] else ".")
        return md + (" The card is one click below." if d.card and d.summary else ""), d.card


def _local_kind(ref: str) -> str | None:
    """The PEFT kind of a local (or shipped) adapter folder, from its adapter_config.json; None for anything else."""
    from layerswap.models.adapters import read_adapter
    from layerswap.models.checkpoints import is_adapter
    from layerswap.models.presets import ASSETS_PREFIX, assets_path

    try:
        path = assets_path(ref) if ref.startswith(ASSETS_PREFIX) else Path(ref).expanduser()
        return read_adapter(path).kind if ref and path.is_dir() and is_adapter(path) else None
    except (UserError, OSError):
        return None
