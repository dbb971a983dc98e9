"""Module-name patterns a model brings (an adapter's ``target_modules``, ``rank_pattern`` keys, ...): only the
shapes people write are accepted, because Python's `re` (which peft and layerswap match them with) has no
time limit and ``(.*.*)*X`` never returns.

    check_pattern(r".*\\.layers\\.(0|1)\\.(self_attn|mlp)\\.(q|v)_proj", "target_modules")   # fine
    check_pattern("(.*.*)*X", "target_modules")                                           # UserError

A safe pattern is an alternation of module names: literal characters (letters, digits, ``_``, ``-``,
``\\.``, and ``.`` for any one character), groups ``( | )`` or ``(?: | )`` of such names with nothing
repeating them, an optional ``^`` / ``$``, and ``.*`` only at the start of a top-level alternative. It has no
repetition but that one prefix, so matching it costs at most (name length) x (its routes) steps; its routes
(the names it spells, counting one per alternative taken) are bounded by `MAX_ROUTES`.
"""

from __future__ import annotations

from .errors import UserError

MAX_ROUTES = 4096  # names one pattern spells: 80 layers x 7 projections x 2 (attention, MLP) is 1,120
MAX_PATTERN_CHARS = 10_000
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_ESCAPED = frozenset(".-_/")
HINT = ("write module names (a list such as [\"q_proj\", \"v_proj\"]) or a plain alternation such as "
        r"'.*\.(q_proj|v_proj)'")


class _Unsafe(Exception):
    pass


class _Parser:
    """A recursive-descent reader of the safe shapes; `routes` of what it read, or `_Unsafe`."""

    def __init__(self, text: str):
        self.s, self.i, self.depth = text, 0, 0

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def alternation(self, top: bool) -> int:
        routes = self.sequence(top)
        while self.peek() == "|":
            self.i += 1
            routes += self.sequence(top)
            if routes > MAX_ROUTES:
                raise _Unsafe(f"it spells more than {MAX_ROUTES:,} names")
        return routes

    def sequence(self, top: bool) -> int:
        if top and self.s.startswith("^", self.i):
            self.i += 1
        if top and self.s.startswith(".*", self.i):  # the one repetition: a prefix of any module path
            self.i += 2
        routes = 1
        while True:
            c = self.peek()
            if c in _NAME_CHARS and c:
                self.i += 1
            elif c == "\\":
                if self.i + 1 >= len(self.s) or self.s[self.i + 1] not in _ESCAPED:
                    raise _Unsafe(f"it escapes {self.s[self.i:self.i + 2]!r}")
                self.i += 2
            elif c == ".":
                self.i += 1
            elif c == "(":
                self.i += 3 if self.s.startswith("(?:", self.i) else 1
                self.depth += 1
                if self.depth > 16:
                    raise _Unsafe("its groups nest more than 16 deep")
                routes *= self.alternation(False)
                if self.peek() != ")":
                    raise _Unsafe(f"{self.s[self.i:self.i + 12]!r} is not part of a module name" if self.peek()
                                  else "a group is not closed")
                self.i += 1
                self.depth -= 1
            elif top and c == "$" and (self.i + 1 == len(self.s) or self.s[self.i + 1] == "|"):
                self.i += 1
            else:
                break
            if self.peek() in ("*", "+", "?", "{"):
                raise _Unsafe(f"it repeats something ({self.s[max(0, self.i - 8):self.i + 1]!r})")
            if routes > MAX_ROUTES:
                raise _Unsafe(f"it spells more than {MAX_ROUTES:,} names")
        return routes


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
