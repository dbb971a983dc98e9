"""A search's records in a sweeps results file (`sweeps.log`): one record per model and chunk of questions,
keyed by content, so a killed search resumes without evaluating anything twice and a later search reuses them.

A record (kind ``search``) holds which model answered (a recipe, or an expert's role), the experts'
content fingerprints, the question set's fingerprint, the evaluation and engine settings, the question
ids and, per language, which of them were answered right. `Answers` indexes every search record of a
results file by what it measured apart from the ids, so any question one search answered is known to
every later search of the same experts, set and settings, whatever its seed or split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from layerswap.evaluation import mgsm
from layerswap.models.cache import content_hash
from layerswap.evaluation.run import EvalConfig
from layerswap.models.presets import portable_ref
from layerswap.recipe.recipes import Recipe
from layerswap.core.roles import ROLE_NAMES
from layerswap.sweeps.log import point_key
from layerswap.sweeps import loop
from layerswap.sweeps.records import experts_identity, experts_shown
from layerswap.search.race import Race, race

KIND = "search"


def set_identity(source) -> dict:
    """The question set by content: every TSV/JSON of its folder hashed (the Hub's set by name)."""
    src = mgsm.folder(source if source is not None else mgsm.default_data_dir())
    if src is None:
        return {"path": f"hub:{mgsm.HUB_DATASET}", "fingerprint": mgsm.HUB_DATASET}
    files = sorted(f for f in src.iterdir() if f.suffix in (".tsv", ".json"))
    return {"path": portable_ref(src), "fingerprint": content_hash((f.name, f.read_bytes()) for f in files)}


def model_of(who: Recipe | str) -> dict:
    """What answered: ``{"recipe": ...}`` for a merge, ``{"model": role}`` for an expert."""
    return {"model": who} if isinstance(who, str) else {"recipe": who.to_dict()}


@dataclass
class Identity:
    """Everything a search's numbers depend on besides the model and the questions."""

    experts: dict
    shown: dict
    force: bool
    test: dict
    evals: dict  # shots, mode, max_new_tokens
    engine: dict
    langs: tuple[str, ...]
    source: str | None

    @classmethod
    def of(cls, checkpoints: dict, force: bool, source, evals: dict, engine: dict, langs) -> "Identity":
        ident = experts_identity(checkpoints)
        return cls(ident, experts_shown(checkpoints, ident), bool(force), set_identity(source), dict(evals),
                   dict(engine), tuple(langs), None if source is None else str(source))

    def model_key(self, model: dict) -> str:
        """The key of everything but the questions (what `Answers` indexes by)."""
        return point_key({"experts": self.experts, "force": self.force, **model,
                          "test": self.test["fingerprint"], "eval": self.evals, "engine": self.engine})

    def config(self, ids) -> EvalConfig:
        return EvalConfig(langs=list(self.langs), ids=tuple(ids), source=self.source, **self.evals)

    def record(self, model: dict, name: str, ids: list[int], correct: dict[str, list[bool]], seconds: float,
               engine_used: str = "") -> dict:
        mkey = self.model_key(model)
        return {"key": point_key({"model_key": mkey, "ids": list(ids), "langs": list(self.langs)}), "model_key": mkey,
                "sweep": "search", "set": "experts", "kind": KIND, "name": name, "recipe": model.get("recipe"),
                "role": model.get("model"), "experts": self.shown, "force": self.force, "test_set": self.test,
                "eval": {"langs": list(self.langs), **self.evals}, "engine": self.engine, "ids": list(ids),
                "correct_flexible": {lang: "".join("1" if x else "0" for x in c) for lang, c in correct.items()},
                "accuracy": {"flexible": {lang: sum(c) / len(c) for lang, c in correct.items()}},
                "n": {lang: len(c) for lang, c in correct.items()}, "engine_used": engine_used, "seconds": seconds}


def identities(wb, cfg, force: bool) -> tuple[Identity, Identity]:
    """The keys of a search's held-out and dev records on the workbench `wb` (`cfg`: a `SearchConfig`): every
    search over the same experts, sets and engine finds the same records."""
    # one key for plain prompts: a chat template of None and of False
    eng = {"engine": wb.engine_choice, "chat_template": wb.chat_template or None}
    test = Identity.of(wb.checkpoints, force, cfg.source, cfg.evals(), eng, cfg.langs)
    dev = test if cfg.dev_source is None else Identity.of(wb.checkpoints, force, cfg.dev_source, cfg.evals(), eng,
                                                          cfg.langs)
    return test, dev


@dataclass
class Answers:
    """Per-question correctness by model key, from a results file's search records."""

    known: dict[str, dict[tuple[str, int], bool]] = field(default_factory=dict)

    @classmethod
    def from_rows(cls, rows) -> "Answers":
        a = cls()
        for r in rows:
            a.add(r)
        return a

    def add(self, row: dict) -> None:
        if row.get("kind") != KIND or "model_key" not in row:
            return
        got = self.known.setdefault(row["model_key"], {})
        for lang, bits in row["correct_flexible"].items():
            for i, bit in zip(row["ids"], bits):
                got[(lang, int(i))] = bit == "1"

    def of(self, mkey: str) -> dict[tuple[str, int], bool]:
        return self.known.get(mkey, {})


@dataclass
class Tally:
    looked: int = 0  # question-evaluations the search used (question x language x model)
    run: int = 0  # of them, answered now (the rest came from the results file)


def scorer(wb, ident: Identity, who: Recipe | str, known: dict, tally: Tally, write, cancel=None, name: str = "",
           progress=None):
    """`score(ids)` for `race`: each question's share of languages answered right by `who`, asking the engine
    (`sweeps.loop.measure`) only for questions `known` lacks (the engines start, and a merge is built, only when
    first needed); `write(record)` keeps each new chunk; `progress` hears each batch answered. None when cancelled."""
    model = model_of(who)
    langs = ident.langs

    def score(ids: list[int]) -> list[float] | None:
        need = [i for i in ids if any((lang, i) not in known for lang in langs)]
        if need:
            if cancel is not None and cancel.is_set():
                return None

            def chunk(m: loop.Measured) -> dict:
                by = {(q.lang, q.index): q.flexible_correct for q in m.report.results}
                known.update(by)
                return ident.record(model, name or ROLE_NAMES.get(m.role, m.role), need,
                                    {lang: [by[(lang, i)] for i in need] for lang in langs}, m.seconds,
                                    m.report.engines.get(m.model, ""))

            if loop.measure(wb, who, ident.config(need), record=chunk, write=write, progress=progress,
                       cancel=cancel).cancelled:
                return None
            tally.run += len(need) * len(langs)
        tally.looked += len(ids) * len(langs)
        return [sum(known[(lang, i)] for lang in langs) / len(langs) for i in ids]

    return score


def race_plan(wb, ident: Identity, plan, name: str, known: dict, dev, sizes, incumbent, z: float, write,
              tally: Tally, cancel=None) -> Race:
    """One candidate's race (`race.race`) on `wb`, its answers from `known` or the engine."""
    score = scorer(wb, ident, Recipe(plan=plan), known, tally, write, cancel, name=name or plan.title())
    return race(score, dev, sizes, incumbent, z)


def race_job(wb, ident: Identity, plan, name: str, known: dict, dev, sizes, incumbent, z: float):
    """A Ray worker's job (`sweeps.ray.Pool`): one candidate's race on the worker's workbench, with the records it
    wrote and its tally, for the driver to keep."""
    records: list[dict] = []
    tally = Tally()
    r = race_plan(wb, ident, plan, name, dict(known), dev, sizes, incumbent, z, records.append, tally)
    return r, records, tally
