"""The engine plan of an expert family: one math expert, N language experts and N merges, on this hardware.

    fp = plan_family(math_ck, {"sw": sw_ck, "te": te_ck}, hardware=flavour("a100-large"))
    fp.residency, fp.awake, fp.asleep, fp.reloaded, fp.switch_seconds    # and fp.trio: one language's `EnginePlan`
    fp.row(hw)                                                             # a row of `inspect --hardware --lang ...`

A family answers one language at a time: that language's trio (the math expert, its expert, its merge) is served
as the trio's own plan says (`planning.plan_engines`, made for the family's largest language expert, `planned_on`:
every arrangement, size, sleep-mode and cost rule is the trio's; LoRA experts are planned on the member whose merge
needs vLLM's highest LoRA rank, or on one vLLM's LoRA cannot serve, which serves the family dense). What the family
adds is what happens to the other languages' models and what a **language switch** costs (`RESIDENCIES`):

- ``trio``: one language, served as its trio; no switch;
- ``adapters``: LoRA experts on one vLLM engine on the base (the trio's ``lora_vllm``): every language's expert and
  merge is an adapter of that engine, all served at once; a switch costs nothing;
- ``all_awake``: every model on an engine of its own, side by side (the trio has three engines, and 1 + 2N engines
  fit: `sizing.estimate`); a switch costs nothing;
- ``sleep`` (a GPU, vLLM): the current language's engines awake, the other languages' expert and merge engines in
  vLLM's sleep mode (their weights parked in pinned host RAM, `planning.PINNED_PER_WEIGHT`, their CUDA contexts
  and graphs kept on the GPU); only where the trio has three engines or itself sleeps, and host RAM and the GPU hold
  that; a switch puts two engines to sleep and wakes two (`planning.sleep_swap_seconds` each);
- ``resident`` (transformers): every expert in memory (1 + N experts fit), a switch rebuilds the merge in memory
  (one model's weights written, at the reload rate: an upper estimate);
- ``reload``: the math expert stays, a switch loads the next language's expert and its merge into the engines
  (`planning.swap_seconds` each);
- ``none``: the trio does not fit (its problem says why).

A family **evaluation** (`serving.family.evaluate_family`) visits each language once and runs `FamilyPlan.runs`:
``trio``, ``adapters``, ``resident`` and ``reload`` as planned (the math expert and its engine loaded once, the
language expert and the merge switched per language); ``all_awake`` and ``sleep`` as ``reload`` in the trio's
engines (engines kept for languages it never returns to would only idle; the note says so).

Headers and the hardware (`layerswap.core.hardware`, fakeable) only; nothing starts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from layerswap.core.hardware import GiB, Hardware, current
from layerswap.engines.planning import (APP_HEADROOM, ASLEEP, GPU_ACTIVATIONS, PINNED_PER_WEIGHT, EnginePlan,
                                        Releasing, _duration, _gib, _round, plan_engines, sleep_swap_seconds,
                                        swap_seconds, weight_bytes)
from layerswap.engines.sizing import USABLE_FRACTION, estimate, vllm_lora_rank
from layerswap.engines.vllm_engine import VLLMSettings
from layerswap.models.checkpoints import Checkpoint

RESIDENCIES = ("trio", "adapters", "all_awake", "sleep", "resident", "reload", "none")
RESIDENCY_TITLES = {"trio": "one language: its trio, no switch",
                    "adapters": "every language's expert and merge an adapter on one engine",
                    "all_awake": "every model on an engine of its own, all awake",
                    "sleep": "the current language awake, the others' engines asleep",
                    "resident": "every expert in memory, the merge rebuilt per language",
                    "reload": "the math expert stays, each language's expert and merge reloaded",
                    "none": "nothing (answers are off)"}
# models of one trio answering without a swap at any time, per arrangement (sleep mode: less those asleep)
TRIO_AWAKE = {"lora_vllm": 3, "three_vllm": 3, "two_vllm": 2, "one_vllm_swapped": 1, "transformers": 3, "none": 0}


@dataclass(frozen=True)
class FamilyPlan:
    trio: EnginePlan  # one language's trio, as served (the family's largest language expert)
    languages: int
    residency: str  # one of RESIDENCIES
    awake: int  # models answering without a swap at any time
    asleep: int  # engines asleep at any time (sleep mode)
    reloaded: int  # models loaded into an engine (or rebuilt) at a language switch
    switch_seconds: float | None  # one language switch (None: nothing serves)
    need_memory: int  # GPU memory (or RAM on the CPU) the whole family takes
    host_pinned: int = 0  # host RAM the sleeping engines pin
    why: str = ""

    @property
    def models(self) -> int:
        """The models a family serves: the math expert, N language experts and N merges."""
        return 1 + 2 * self.languages

    @property
    def fits(self) -> bool:
        return self.residency != "none"

    @property
    def title(self) -> str:
        return RESIDENCY_TITLES[self.residency]

    def describe(self) -> str:
        """One line: how the family's models answer, and what a language switch costs."""
        if not self.fits:
            return f"A family of {self.languages}: answers are off ({self.trio.problem.rstrip('.')})."
        where = "GPU memory" if self.trio.device != "cpu" else "RAM"
        s = (f"A family of {self.languages} ({self.models} models): {self.title}; each language's trio as "
             f"{self.trio.title}; {_gib(self.need_memory)} of {where}")
        if self.host_pinned:
            s += f", {_gib(self.host_pinned)} of host RAM pinned by {self.asleep} sleeping engines"
        took = _duration(self.switch_seconds or 0)
        cost = "no cost" if not self.switch_seconds else took if took.startswith("under") else f"about {took}"
        return s + f"; a language switch: {cost} ({self.why})."

    @property
    def runs(self) -> tuple[str, str]:
        """(residency, why) a family evaluation runs (see the module's docstring): the plan's, except that the
        engines it would keep for other languages (``all_awake``, ``sleep``) are not started."""
        if self.residency not in ("all_awake", "sleep"):
            return self.residency, self.why
        return "reload", (f"the plan ({self.residency}: {self.title}) keeps engines for switching back; an evaluation "
                          "visits each language once, so the trio's engines load the next language's expert and "
                          "merge instead")

    def row(self, hw: Hardware) -> dict:
        """The trio's `EnginePlan.row` with the family's columns (`inspect --hardware` over a family)."""
        row = self.trio.row(hw)
        gpu = self.fits and self.trio.device != "cpu"
        return {**row, "languages": self.languages, "models": self.models, "residency": self.residency,
                "awake": self.awake if self.fits else 0, "asleep": self.asleep, "reloaded_per_switch": self.reloaded,
                "seconds_per_switch": None if self.switch_seconds is None else _round(self.switch_seconds),
                "gpu_planned_gib": round(self.need_memory / GiB, 2) if gpu else None,
                "host_pinned_gib": round(self.host_pinned / GiB, 2),
                "note": row["note"] if not self.fits else f"{self.title}; {self.why}; the trio: {row['note']}"}


def planned_on(math: Checkpoint, langs: dict[str, Checkpoint]) -> Checkpoint:
    """The language expert the family's trio is planned on: the largest, so every member fits where it does. For
    LoRA experts (`sizing.vllm_lora_rank`), the one whose merge needs the highest rank, so the one engine on the
    base serves every member; if vLLM's LoRA cannot serve one of them, that one, so the family is served dense."""
    largest = max(langs.values(), key=lambda ck: ck.nbytes)
    if not (math.adapter_kind == "lora" and any(ck.adapter_kind == "lora" for ck in langs.values())):
        return largest
    ranks = [(vllm_lora_rank({"math": math, "lang": ck})[0], ck) for ck in langs.values()]
    unserved = [ck for r, ck in ranks if r is None]
    if unserved:
        return max(unserved, key=lambda ck: ck.nbytes)
    return max(ranks, key=lambda rc: (rc[0], rc[1].nbytes))[1]


def plan_family(math: Checkpoint, langs: dict[str, Checkpoint], *, engine: str = "auto", serving: str = "auto",
                settings: VLLMSettings | None = None, device: str | None = None, hardware: Hardware | None = None,
                releasing: Releasing = Releasing()) -> FamilyPlan:
    """The family's engine plan (see the module's docstring); never starts anything."""
    hw = hardware or current()
    settings = settings or VLLMSettings()
    n = len(langs)
    trio = plan_engines({"math": math, "lang": planned_on(math, langs)}, engine=engine, serving=serving,
                        settings=settings, device=device, hardware=hw, releasing=releasing, alternatives=False)
    if not trio.fits:
        return FamilyPlan(trio, n, "none", 0, 0, 0, None, 0, why=trio.problem)
    if n == 1:
        asleep = ASLEEP.get(trio.arrangement, 0) if trio.sleep else 0
        return FamilyPlan(trio, 1, "trio", TRIO_AWAKE[trio.arrangement], asleep, 0, 0.0, trio.need_memory,
                          trio.host_pinned, why="one language: no switch")
    if trio.engine == "vllm":
        return _vllm(math, trio, n, settings, hw, releasing)
    return _transformers(math, langs, trio, n, hw, releasing)


def _vllm(math: Checkpoint, trio: EnginePlan, n: int, settings: VLLMSettings, hw: Hardware,
          releasing: Releasing) -> FamilyPlan:
    dev = trio.device
    per_model = weight_bytes(math, settings.engine_dtype(math.config, dev))
    usable = int(USABLE_FRACTION * trio.available_memory)
    if trio.arrangement == "lora_vllm":
        return FamilyPlan(trio, n, "adapters", 1 + 2 * n, 0, 0, 0.0, trio.need_memory,
                          why="every model an adapter of the one engine on the base")
    awake = TRIO_AWAKE[trio.arrangement]
    if trio.arrangement == "three_vllm":  # the trio's engine settings (context, KV cache, CUDA graphs), 1 + 2N times
        tp = max(1, settings.tensor_parallel_size) if dev != "cpu" else 1
        have = hw.memory_available(dev, tp) + releasing.nbytes
        est = estimate(math, 1 + 2 * n, trio.settings or settings, dev, have, APP_HEADROOM[dev])
        if est.fits:
            return FamilyPlan(trio, n, "all_awake", 1 + 2 * n, 0, 0, 0.0, est.need_bytes,
                              why=f"{1 + 2 * n} engines fit side by side")
    reload = FamilyPlan(trio, n, "reload", awake, ASLEEP.get(trio.arrangement, 0) if trio.sleep else 0, 2,
                        2 * swap_seconds(per_model, dev), trio.need_memory, trio.host_pinned,
                        why="the next language's expert and merge loaded from disk")
    if dev == "cpu":
        return replace(reload, why=reload.why + " (vLLM's sleep mode is for GPUs)")
    if trio.arrangement != "three_vllm" and not trio.sleep:
        return replace(reload, why=reload.why + f" (the trio takes turns without sleep mode: {trio.sleep_why})")
    # the other languages' expert and merge engines sleep: their CUDA contexts and graphs stay on the GPU
    others = 2 * (n - 1)
    sleepers = 2 * n + (1 if trio.arrangement == "one_vllm_swapped" else 0)  # every engine that ever sleeps
    pinned = int(sleepers * PINNED_PER_WEIGHT * per_model)
    ram = int(USABLE_FRACTION * hw.ram_available)
    extra = others * (trio.estimate.overhead_bytes - GPU_ACTIVATIONS)
    if pinned + APP_HEADROOM["cpu"] > ram:
        return replace(reload, why=reload.why + f" ({sleepers} sleeping engines would pin {_gib(pinned)} of host RAM, "
                                                f"{_gib(ram)} usable)")
    if trio.need_memory + extra > usable:
        return replace(reload, why=reload.why + f" ({others} more sleeping engines would add {_gib(extra)} of GPU "
                                                "memory that is not there)")
    asleep = others + (ASLEEP.get(trio.arrangement, 0) if trio.sleep else 0)
    return FamilyPlan(trio, n, "sleep", awake, asleep, 0,
                      2 * sleep_swap_seconds(per_model), trio.need_memory + extra, pinned,
                      why=f"two engines sleep and two wake; {sleepers} engines pin {_gib(pinned)} of host RAM")


def _transformers(math: Checkpoint, langs: dict[str, Checkpoint], trio: EnginePlan, n: int, hw: Hardware,
                  releasing: Releasing) -> FamilyPlan:
    dev = trio.device
    have = hw.memory_available(dev) + releasing.nbytes
    need = math.nbytes + sum(ck.nbytes for ck in langs.values()) + APP_HEADROOM[dev]
    per_model = math.nbytes
    if need <= have:
        return FamilyPlan(trio, n, "resident", 2 + n, 0, 1, swap_seconds(per_model, dev), need,
                          why=f"the {n} language experts fit in memory beside the math expert; the merge is rebuilt")
    return FamilyPlan(trio, n, "reload", 3, 0, 2, 2 * swap_seconds(per_model, dev), trio.need_memory,
                      why=f"the {n} language experts need {_gib(need)}, {_gib(have)} available: the next "
                          "language's expert read from disk and its merge built")


def family_hardware_table(math: Checkpoint, langs: dict[str, Checkpoint], names: list[str], engine: str = "auto",
                          serving: str = "auto", settings: VLLMSettings | None = None) -> list[dict]:
    """One `FamilyPlan.row` per hardware name (a Spaces flavour, or ``this``)."""
    from layerswap.core.hardware import flavour

    return [plan_family(math, langs, engine=engine, serving=serving, settings=settings, hardware=flavour(name))
            .row(flavour(name)) for name in names]


def family_table_markdown(rows: list[dict]) -> str:
    """The family's hardware table as Markdown (`inspect --hardware` with several --lang CODE=L)."""
    lines = ["| hardware | GPU memory | RAM | per language | family | awake | asleep | reloaded per switch | "
             "GPU planned | host pinned | s per question | s per language switch |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gpu = f"{r['gpu_memory_gib']:g} GiB" + (f" × {r['gpus']}" if r["gpus"] > 1 else "") if r["gpus"] else "none"
        cell = lambda v, unit="": "" if v is None else f"{v:g}{unit}"  # noqa: E731
        lines.append(f"| `{r['hardware']}` | {gpu} | {r['ram_gib']:g} GiB | `{r['arrangement']}` | "
                     f"`{r['residency']}` | {r['awake']} | {r['asleep']} | {r['reloaded_per_switch']} | "
                     f"{cell(r['gpu_planned_gib'], ' GiB')} | {cell(r['host_pinned_gib'] or None, ' GiB')} | "
                     f"{cell(r['seconds_per_question'])} | {cell(r['seconds_per_switch'])} |")
    return "\n".join(lines)


__all__ = ["RESIDENCIES", "FamilyPlan", "family_hardware_table", "family_table_markdown",
           "plan_family"]
