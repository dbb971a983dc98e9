"""Module-name patterns a model brings (an adapter's ``target_modules``, ``rank_pattern`` keys, ...): only the
shapes people write are accepted, because Python's `re` (which peft and layerswap match them with) has no
time limit and ``(.*.*)*X`` never returns.

    check_pattern(r".*\\.layers\\.(0|1)\\.(self_attn|mlp)\\.(q|v)_proj", "target_modules")   # fine
    check_pattern("(.*.*)*X", "target_modules")                                           # UserError

A safe pattern is an alternation of module names: literal characters (letters, digits, ``_``, ``-``,
``\\.``, and ``.`` for any one character), groups ``( | )`` or ``(?: | )`` of such names with nothing
repeating them, an optional ``^`` / ``$``, and ``.*`` only at the start of a top-level alternative. It has no
repetition but that one prefix, so matching it costs at most (name length) x (its routes) x (its length) steps;
its routes (the ways one name can match it: per group of literal names, as many as are prefixes of one another;
per group of other alternatives, their sum; groups in a row multiply) are bounded by `MAX_ROUTES`.
"""

from __future__ import annotations

from layerswap.core.errors import UserError

MAX_ROUTES = 64  # ways one module name can be matched (80 layers spelt out, "(0|1|...|79)", are 2: "7", "79")
MAX_ALTERNATIVES = 256  # names in one alternation (32 layers x 7 projections spelt out is 224)
MAX_PATTERN_CHARS = 10_000
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_ESCAPED = frozenset(".-_/")
HINT = ("write module names (a list such as [\"q_proj\", \"v_proj\"]) or a plain alternation such as "
        r"'.*\.(q_proj|v_proj)'")


_ANY = "\0"  # an unescaped "." in a name: any one character


def _overlap(a: str, b: str) -> bool:
    """Whether names `a` and `b` (`_ANY` for any character) can both match at one place of one module name."""
    return all(x == y or _ANY in (x, y) for x, y in zip(a, b))


class _Unsafe(Exception):
    pass


class _Parser:
    """A recursive-descent reader of the safe shapes; `routes` of what it read, or `_Unsafe`."""

    def __init__(self, text: str):
        self.s, self.i, self.depth = text, 0, 0

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def alternation(self, top: bool) -> int:
        """The routes of ``a|b|...``: where every alternative is a name (``.`` for any one character allowed), as
        many as can match at one place (the most names that agree with a longer one where neither has ``.``),
        else their sum."""
        parts = [self.sequence(top)]
        while self.peek() == "|":
            self.i += 1
            parts.append(self.sequence(top))
            if len(parts) > MAX_ALTERNATIVES:
                raise _Unsafe(f"it has more than {MAX_ALTERNATIVES:,} alternatives")
        names = [name for _, name in parts]
        if all(n is not None for n in names):
            routes = max(sum(len(b) <= len(a) and _overlap(a, b) for b in names) for a in names)
        else:
            routes = sum(r for r, _ in parts)
        if routes > MAX_ROUTES:
            raise _Unsafe(f"up to {routes:,} of its names can match at one place (at most {MAX_ROUTES:,})")
        return routes

    def sequence(self, top: bool) -> tuple[int, str | None]:
        """The routes of one alternative, and its text when it is a literal name (else None)."""
        start, literal = self.i, ""
        if top and self.s.startswith("^", self.i):
            self.i += 1
        if top and self.s.startswith(".*", self.i):  # the one repetition: a prefix of any module path
            self.i += 2
        routes, literal = 1, "" if self.i == start else None
        while True:
            c = self.peek()
            if c in _NAME_CHARS and c:
                self.i += 1
                literal = None if literal is None else literal + c
            elif c == "\\":
                if self.i + 1 >= len(self.s) or self.s[self.i + 1] not in _ESCAPED:
                    raise _Unsafe(f"it escapes {self.s[self.i:self.i + 2]!r}")
                literal = None if literal is None else literal + self.s[self.i + 1]
                self.i += 2
            elif c == ".":
                self.i, literal = self.i + 1, None if literal is None else literal + _ANY
            elif c == "(":
                self.i += 3 if self.s.startswith("(?:", self.i) else 1
                self.depth += 1
                if self.depth > 16:
                    raise _Unsafe("its groups nest more than 16 deep")
                routes, literal = routes * self.alternation(False), None
                if self.peek() != ")":
                    raise _Unsafe(f"{self.s[self.i:self.i + 12]!r} is not part of a module name" if self.peek()
                                  else "a group is not closed")
                self.i += 1
                self.depth -= 1
            elif top and c == "$" and (self.i + 1 == len(self.s) or self.s[self.i + 1] == "|"):
                self.i, literal = self.i + 1, None
            else:
                break
            if self.peek() in ("*", "+", "?", "{"):
                raise _Unsafe(f"it repeats something ({self.s[max(0, self.i - 8):self.i + 1]!r})")
            if routes > MAX_ROUTES:
                raise _Unsafe(f"up to {routes:,} of its names can match at one place (at most {MAX_ROUTES:,})")
        return routes, literal


def pattern_problem(text: object) -> str | None:
    """Why `text` is not a safe module-name pattern (None when it is one)."""
    if not isinstance(text, str):
        return f"it is a {type(text).__name__}, not text"
    if len(text) > MAX_PATTERN_CHARS:
        return f"it is {len(text):,} characters long (at most {MAX_PATTERN_CHARS:,})"
    p = _Parser(text)
    try:
        p.alternation(True)
        if p.i != len(text):
            raise _Unsafe(f"{text[p.i:p.i + 12]!r} is not part of a module name")
    except _Unsafe as e:
        return str(e)
    return None


def pattern_routes(text: str) -> int:
    """The names a safe pattern spells (one per alternative taken); check it with `check_pattern` first."""
    return _Parser(text).alternation(True)


def check_pattern(text: object, what: str) -> str:
    """`text` when it is a safe module-name pattern (`pattern_problem`); else UserError naming `what`."""
    why = pattern_problem(text)
    if why is not None:
        raise UserError(f"{what} is not a plain list of module names ({why}): {HINT}.")
    return text  # type: ignore[return-value]


def check_name(text: object, what: str) -> str:
    """`text` when it is a plain dotted module name (letters, digits, ``_``, ``-``, ``.``); else UserError."""
    if not isinstance(text, str) or not text or len(text) > 1000 or not set(text) <= _NAME_CHARS | {"."}:
        raise UserError(f"{what} must be a module name such as 'lm_head' or 'model.norm' (got {str(text)[:40]!r}).")
    return text
