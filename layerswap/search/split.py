"""The dev / test split of a search: disjoint by construction, the same for every language, recorded.

    split = split_questions(["sw", "te"], source="mgsm/", seed=0)
    split.dev, split.test                  # question ids: the search sees only dev; test scores the choice

MGSM's languages are translations of one set of problems, so a question id is one problem in every
language: the ids are shuffled once (``random.Random(f"layerswap-split-{seed}")``), the first `dev` are
the dev set and the rest (or the next `test`) the held-out test set. A problem is never on both sides in
any language. The dev order is the order questions are evaluated in (successive halving reads prefixes).

Models that bring their own dev questions (an organism's ``mgsm/dev``, `organisms.choice`) are searched on those
(`dev_source`): the first `dev` of that file (in an order shuffled with the seed), and the held-out questions are
the first `test` of the test set (default all of it), which the search never sees. The split records which.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from layerswap.evaluation import mgsm
from layerswap.core.errors import UserError
from layerswap.models.presets import portable_ref

DEV_SHARE = 0.4  # of the set, when `dev` is not given
DEV_MAX = 400


@dataclass(frozen=True)
class Split:
    seed: int
    langs: tuple[str, ...]
    dev: tuple[int, ...]  # in evaluation order
    test: tuple[int, ...]  # sorted
    total: int  # problems in the set
    dev_source: str | None = None  # the dev file's folder; None: dev drawn from the test set's problems
    dev_total: int = 0  # questions in that dev file

    @property
    def chosen_on(self) -> str:
        """Which questions the choice was made on, in words (the page and the CLI say it)."""
        if self.dev_source:
            return (f"{len(self.dev)} of the {self.dev_total} questions of the models' own dev file "
                    f"{portable_ref(self.dev_source)}; held out: {len(self.test)} questions of the test set, "
                    "never seen")
        return (f"{len(self.dev)} questions drawn from the {self.total} of the set (seed {self.seed}); held out: "
                f"{len(self.test)} others, never seen")

    def to_dict(self) -> dict:
        return {"seed": self.seed, "langs": list(self.langs), "total": self.total, "dev": list(self.dev),
                "test": list(self.test), "dev_source": self.dev_source, "chosen_on": self.chosen_on}


def _size(langs: list[str], source) -> int:
    sizes = {code: len(mgsm.load(code, source)) for code in langs}
    if len(set(sizes.values())) > 1:
        raise UserError("The languages' sets differ in size (" + ", ".join(f"{c}: {n}" for c, n in sizes.items())
                        + "): a search needs parallel sets (question i the same problem in each language).")
    return min(sizes.values())


def split_questions(langs: list[str], source=None, seed: int = 0, dev: int | None = None,
                    test: int | None = None, dev_source=None) -> Split:
    """Shuffle the set's problem ids with `seed`; `dev` of them (default 40 % of the set, at most 400) for the
    search, `test` of the rest (default all of them) held out. With `dev_source` (a folder of dev questions),
    dev is the first `dev` of its questions (default all) and test the first `test` of the set (default all)."""
    if not langs:
        raise UserError("Choose at least one language for the search.")
    total = _size(langs, source)
    if dev_source is not None:
        return _from_file(langs, source, seed, dev, test, dev_source, total)
    if total < 2:
        raise UserError(f"A search needs at least 2 questions per language (dev and test); the set has {total}.")
    n_dev = min(DEV_MAX, max(1, round(DEV_SHARE * total))) if dev is None else dev
    if not isinstance(n_dev, int) or not 1 <= n_dev <= total - 1:
        raise UserError(f"dev is a number of questions from 1 to {total - 1} (the set has {total}; at least one "
                        f"stays held out), not {dev!r}.")
    n_test = total - n_dev if test is None else test
    if not isinstance(n_test, int) or not 1 <= n_test <= total - n_dev:
        raise UserError(f"test is a number of held-out questions from 1 to {total - n_dev}, not {test!r}.")
    ids = list(range(total))
    random.Random(f"layerswap-split-{seed}").shuffle(ids)
    return Split(seed, tuple(langs), tuple(ids[:n_dev]), tuple(sorted(ids[n_dev:n_dev + n_test])), total)


def _from_file(langs: list[str], source, seed: int, dev: int | None, test: int | None, dev_source, total: int) -> Split:
    n_all = _size(langs, dev_source)
    n_dev = n_all if dev is None else dev
    if not isinstance(n_dev, int) or not 1 <= n_dev <= n_all:
        raise UserError(f"dev is a number of questions from 1 to {n_all} (the dev file has {n_all}), not {dev!r}.")
    n_test = total if test is None else test
    if not isinstance(n_test, int) or not 1 <= n_test <= total:
        raise UserError(f"test is a number of held-out questions from 1 to {total}, not {test!r}.")
    ids = list(range(n_dev))
    random.Random(f"layerswap-split-{seed}").shuffle(ids)
    return Split(seed, tuple(langs), tuple(ids), tuple(range(n_test)), total, str(dev_source), n_all)
