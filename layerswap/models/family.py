"""An expert family: one math expert, N language experts (each with its MGSM language code) and their shared base.

    family = Family.parse("math/", ["sw=lang-sw/", "te=lang-te/"], base="base/")   # --lang CODE=REF, repeatable
    family.codes                        # ('sw', 'te')
    check_family(family)                # every member against the math expert and the base, headers + a few MB

The paper's table is one math expert swapped with each of several language experts. A family is that, as data:
`Family.parse` reads the ``CODE=REF`` specs the CLI (``--lang``) and the page give, bounding and validating each code
(shape only: which codes have a test set is the MGSM data's to say, `serving.family.check_test_sets`), refusing a
code given twice and more members than the cap (`MAX_LANGS`; hosted mode lowers it: `hosting.Policy.family_cap`).
`check_family` is the one compatibility check of a whole family (`pairing.check_mergeable` per member), made once
before anything heavy; each refusal is one `UserError` line naming the member and what to do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

from layerswap.core.errors import UserError
from layerswap.models.pairing import BASE_DISTANCE_THRESHOLD, check_mergeable

MAX_LANGS = 8  # language experts in one family (hosted mode: fewer, `hosting.Limits.family_langs`)
MAX_SPEC_CHARS = 1000  # one CODE=REF as given
CODE_RE = re.compile(r"[a-z][a-z0-9_]{1,15}")  # MGSM codes (sw, te, ...) and the organisms' own (xx, yy)
_SPEC_RE = re.compile(r"([A-Za-z][A-Za-z0-9_-]{0,31})\s*=(.*)", re.S)  # CODE=REF: a word, then '=' (no '/' before it)


@dataclass(frozen=True)
class Member:
    """One language expert of a family: its MGSM language code and its model reference."""

    code: str
    ref: str

    @property
    def spec(self) -> str:
        return f"{self.code}={self.ref}"


@dataclass(frozen=True)
class Family:
    """One math expert, language experts (in the order given) and the base they were all fine-tuned from."""

    math: str
    members: tuple[Member, ...]
    base: str | None = None

    @property
    def codes(self) -> tuple[str, ...]:
        return tuple(m.code for m in self.members)

    def member(self, code: str) -> Member:
        for m in self.members:
            if m.code == code:
                return m
        raise UserError(f"The family has no {code} expert; it has: {', '.join(self.codes)}.")

    @classmethod
    def parse(cls, math: str, specs: Sequence[str], base: str | None = None, *, cap: int = MAX_LANGS) -> "Family":
        """A family from ``CODE=REF`` specs (each code once, at most `cap` of them), checked (`validate`)."""
        members = []
        for spec in specs:
            code, ref = split_spec(spec)
            if code is None:
                raise UserError(f"--lang {_shown(spec)}: in a family every language expert needs its MGSM language; "
                                f"write --lang CODE={_shown(spec)} (e.g. sw={_shown(spec)}).")
            members.append(Member(code, ref))
        family = cls(math, tuple(members), base or None)
        family.validate(cap)
        return family

    def validate(self, cap: int = MAX_LANGS) -> None:
        """Codes well formed and each given once, references given, at most `cap` language experts (refused
        before anything is opened)."""
        cap = min(cap, MAX_LANGS)
        if not self.math:
            raise UserError("A family needs its math expert: give --math M.")
        if not self.members:
            raise UserError("A family needs at least one language expert: give --lang CODE=REF.")
        if len(self.members) > cap:
            raise UserError(f"This family has {len(self.members)} language experts; at most {cap} are allowed here: "
                            f"drop {', '.join(m.code for m in self.members[cap:])}.")
        seen: dict[str, str] = {}
        for m in self.members:
            check_code(m.code)
            if not m.ref.strip():
                raise UserError(f"--lang {m.code}=: give the {m.code} expert's folder or Hub id after '='.")
            if m.code in seen:
                raise UserError(f"Two language experts for {m.code} ({_shown(seen[m.code])} and {_shown(m.ref)}); "
                                f"keep one --lang {m.code}=REF.")
            seen[m.code] = m.ref


def check_code(code: str) -> str:
    """A language code's shape: lowercase letters, digits and '_', 2 to 16 characters (MGSM's are two letters)."""
    if not CODE_RE.fullmatch(code):
        raise UserError(f"{_shown(code)} is not a language code: use the MGSM code of the expert's language, "
                        "lowercase (sw, te, bn, ja, ...).")
    return code


def split_spec(spec: str) -> tuple[str | None, str]:
    """``CODE=REF`` -> (code, ref); a plain reference -> (None, ref). A code is a word before the first '='
    (no '/' or '.' before it, so folders and Hub ids with an '=' later in them stay references)."""
    if not isinstance(spec, str) or len(spec) > MAX_SPEC_CHARS:
        raise UserError(f"--lang takes [CODE=]REF of at most {MAX_SPEC_CHARS} characters.")
    m = _SPEC_RE.fullmatch(spec.strip())
    if m is None:
        return None, spec.strip()
    return m.group(1), m.group(2).strip()


def _shown(text: str, limit: int = 80) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


@dataclass(frozen=True)
class FamilyCheck:
    """The family's compatibility, checked: its number of layers and each member's shared-base line."""

    num_layers: int
    lines: dict[str, str]  # code -> the pairing's message (shared base, or why it is waived)


def check_family(family: Family, *, force: bool = False, threshold: float = BASE_DISTANCE_THRESHOLD,
                 pair_check: Callable[[object, object], object] | None = None) -> FamilyCheck:
    """Every language expert against the math expert and the shared base (`pairing.check_mergeable`: headers,
    then a few MB of sampled weights; and `pair_check(math, lang)`, a caller's check of the two opened experts that
    raises `UserError`), before anything heavy; the first member that does not fit is refused by code and
    reference, with what to do. Nothing is kept open."""
    from layerswap.models.adapters import open_expert
    from layerswap.models.checkpoints import Checkpoint

    opened = []
    try:
        base = Checkpoint.open(family.base) if family.base else None
        opened.append(base)
        math = open_expert(family.math, family.base)
        opened.append(math)
        lines = {}
        for m in family.members:
            who = f"The {m.code} expert ({_shown(m.ref)})"
            try:
                lang = open_expert(m.ref, family.base)
            except UserError as e:
                raise UserError(f"{who}: {e}") from None
            opened.append(lang)
            if pair_check is not None:
                try:
                    pair_check(math, lang)
                except UserError as e:
                    raise UserError(f"{who}: {e}") from None
            check = check_mergeable(math, lang, base, threshold=threshold, force=force)
            problem = check.problem()
            if problem:
                raise UserError(f"{who} does not fit this family (math expert {_shown(family.math)}"
                                f"{', base ' + _shown(family.base) if family.base else ''}): {problem.rstrip('.')}; "
                                f"replace it with an expert fine-tuned from the family's base, or drop --lang "
                                f"{m.code}=.")
            lines[m.code] = check.pairing.message()
        return FamilyCheck(math.num_layers, lines)
    finally:
        for ck in opened:
            if ck is not None:
                ck.close()


__all__ = ["MAX_LANGS", "Family", "FamilyCheck", "Member", "check_code", "check_family", "split_spec"]
