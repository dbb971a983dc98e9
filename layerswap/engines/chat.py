"""A model's chat template, rendered with bounds: what transformers' ``apply_chat_template`` renders, but no
template a model brings can run for long, grow memory or print without end.

    text = render_chat(tokenizer, "2+2?", where="org/model")   # or UserError naming the template's file

The template runs in Jinja's immutable sandbox (as transformers runs it) and, besides:
- the render's own Python frames are traced: every line counts against `MAX_TEMPLATE_STEPS` and the wall
  clock (`MAX_TEMPLATE_SECONDS`), and no variable may hold more than `MAX_TEMPLATE_CHARS` characters;
- operators, calls and filters that build text or numbers (``*``, ``**``, ``%``, ``+``, ``~``, ``center``,
  ``indent``, ``replace``, ``join``, ``format``, ``tojson``, widths) are refused when their result would pass
  `MAX_TEMPLATE_CHARS` (counted through lists: ``[s] * 1000`` holds 1000 times ``s``) or 65,536 bits;
  ``lipsum`` is gone;
- the output is read chunk by chunk and stops at `MAX_TEMPLATE_CHARS`; the template's source at
  `MAX_TEMPLATE_SOURCE` characters.
Any failure is one UserError line naming the file the template came from.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from pathlib import Path

from layerswap.core.bounds import MAX_TEMPLATE_CHARS, MAX_TEMPLATE_SECONDS, MAX_TEMPLATE_SOURCE, MAX_TEMPLATE_STEPS
from layerswap.core.errors import UserError

# a format width (or precision) of a million or more, or one taken from an argument: %-style and {}-style
_WIDE = re.compile(r"%[-#0 +]*(\d{7,}|\*)|%[-#0 +]*\d*\.(\d{7,}|\*)|\{[^{}]*:[^{}]*(\d{7,}|\{)")


class TemplateLimit(Exception):
    """A chat template passed one of the bounds."""


def _sized(x: object, depth: int = 0) -> int:
    """What `x` holds: characters of its strings and items of its lists, tuples and dicts, counted through them
    (``[s] * 1000`` holds 1000 times ``s``), stopping past `MAX_TEMPLATE_CHARS`; too deep counts as too much."""
    if isinstance(x, (str, bytes)):
        return len(x)
    if not isinstance(x, (list, tuple, dict)):
        return 0
    if depth > 32:
        return MAX_TEMPLATE_CHARS + 1
    total = len(x)
    for item in (x.items() if isinstance(x, dict) else x):
        if total > MAX_TEMPLATE_CHARS:
            break
        total += _sized(item, depth + 1)
    return total


def _check_int(what: str, bits: int) -> None:
    if bits > 2**16:
        raise TemplateLimit(f"{what} would build a number of {bits:,} bits")


def _check_numbers(what: str, args) -> None:
    """No count or width beyond `MAX_TEMPLATE_CHARS` (``center(10**9)``, ``indent(...)``, ``truncate(...)``)."""
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_TEMPLATE_CHARS:
            raise TemplateLimit(f"{what} with {a:,}" if abs(a) < 10**15 else f"{what} with a number over 10**15")


def _check_format(what: str, fmt: object) -> None:
    if isinstance(fmt, str) and _WIDE.search(fmt):
        raise TemplateLimit(f"{what} with a width of a million or more")


def _check_result(what: str, size: int) -> None:
    if size > MAX_TEMPLATE_CHARS:
        raise TemplateLimit(f"{what} would build {size:,} characters (at most {MAX_TEMPLATE_CHARS:,})")


def _replace_size(text: object, new: object) -> int:
    return _sized(text) + (_sized(text) + 1) * _sized(new)


def _join_size(sep: object, items: object) -> int:
    if isinstance(items, str):
        return (_sized(sep) + 1) * len(items)
    if not isinstance(items, (list, tuple, dict)):
        return 0
    total = _sized(sep) * len(items)
    for i in items:
        if total > MAX_TEMPLATE_CHARS:
            break
        total += _sized(i)
    return total


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    from jinja2 import ext, nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    class BoundedNamespace(Namespace):
        def __setitem__(self, name, value):
            _check_result("a namespace value", _sized(value))
            super().__setitem__(name, value)

    class BoundedCode(CodeGenerator):
        """Jinja's compiler, but ``a ~ b`` (which no sandbox hook sees) calls `Bounded.bounded_concat`."""

        def visit_Concat(self, node, frame):  # noqa: N802 (Jinja's name)
            self.write("environment.bounded_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+"})
        code_generator_class = BoundedCode

        def call_binop(self, context, operator, left, right):
            ints = isinstance(left, int) and isinstance(right, int)
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
                raise TemplateLimit(f"a power of {right}")
            if operator == "**" and ints and abs(left) > 1:
                _check_int("a power", left.bit_length() * abs(right))
            if operator == "*" and ints:
                _check_int("a product", left.bit_length() + right.bit_length())
            elif operator == "*":
                n, seq = (right, left) if isinstance(right, int) else (left, right)
                if isinstance(n, int):
                    _check_result("a repetition", _sized(seq) * max(int(n), 0))
            if operator == "+":
                _check_result("a sum", _sized(left) + _sized(right))
            if operator == "%":
                _check_format("a % format", left)
                _check_result("a % format", _sized(left) + _sized(right))
            return super().call_binop(context, operator, left, right)

        def bounded_concat(self, values) -> str:  # `a ~ b ~ ...` (see BoundedCode)
            _check_result("a ~ concatenation", sum(_sized(v) for v in values))
            return "".join(map(str, values))

        def wrap_str_format(self, value):  # "{:>99999999}".format(...): Jinja wraps it when it is read
            if getattr(value, "__name__", "") in ("format", "format_map"):
                _check_format(value.__name__, getattr(value, "__self__", None))
            return super().wrap_str_format(value)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
            name, owner = getattr(__obj, "__name__", "a call"), getattr(__obj, "__self__", None)
            _check_numbers(name, (*args, *kwargs.values()))
            if name in ("format", "format_map"):  # str.format as Jinja wraps it: what it is given
                _check_result(name, sum(_sized(a) for a in (*args, *kwargs.values())))
            if isinstance(owner, str):  # a method of a string: its own bounds
                if name == "replace" and len(args) >= 2:
                    _check_result(name, _replace_size(owner, args[1]))
                elif name == "join" and args:
                    _check_result(name, _join_size(owner, args[0]))
                elif name == "expandtabs":
                    _check_result(name, len(owner) + owner.count("\t") * int((args or [8])[0]))
            return super().call(__context, __obj, *args, **kwargs)

    def bounded_filter(name, f):
        @functools.wraps(f)
        def run(*args, **kwargs):
            own = args[1:] if getattr(f, "jinja_pass_arg", None) else args  # without Jinja's context
            _check_numbers(f"the {name} filter", (*own, *kwargs.values()))
            if name == "format" and own:
                _check_format("the format filter", own[0])
                _check_result("the format filter", sum(_sized(a) for a in (*own, *kwargs.values())))
            if name == "indent" and own:
                width = own[1] if len(own) > 1 else kwargs.get("width", 4)
                _check_result("the indent filter", _sized(own[0]) + (str(own[0]).count("\n") + 1) *
                              (width if isinstance(width, int) else _sized(width)))
            if name == "wordwrap" and own:
                wrap = kwargs.get("wrapstring", own[4] if len(own) > 4 else None) or "\n"
                _check_result("the wordwrap filter", _sized(own[0]) * (1 + _sized(wrap)))
            if name == "replace" and len(own) >= 3:
                _check_result("the replace filter", _replace_size(own[0], own[2]))
            if name == "join" and own:
                _check_result("the join filter", _join_size(own[1] if len(own) > 1 else kwargs.get("d", ""), own[0]))
            return f(*args, **kwargs)
        return run

    def raise_exception(message):
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):  # transformers' own
        if indent is not None and not (isinstance(indent, int) and 0 <= indent <= 8):
            raise TemplateLimit(f"tojson with an indent of {str(indent)[:20]} (at most 8)")
        _check_result("tojson", _sized(x) * (10 if indent else 1))
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Generation(ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks assistant turns with it): the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols, Generation])
    env.globals.pop("lipsum", None)  # lipsum(n=999999) writes a million paragraphs; no chat template uses it
    env.filters = {k: bounded_filter(k, f) for k, f in env.filters.items()}
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, namespace=BoundedNamespace,
                       strftime_now=lambda fmt: time.strftime(str(fmt)[:100]))
    return env.from_string(source)


class _Tracer:
    """Counts the template's lines, watches the clock and the size of its variables (its own frames only)."""

    def __init__(self):
        self.steps, self.deadline = 0, time.monotonic() + MAX_TEMPLATE_SECONDS

    def __call__(self, frame, event, arg):
        if frame.f_code.co_filename != "<template>":
            return None
        return self.line

    def line(self, frame, event, arg):
        if event == "line":
            self.steps += 1
            if self.steps > MAX_TEMPLATE_STEPS:
                raise TemplateLimit(f"it runs more than {MAX_TEMPLATE_STEPS:,} steps")
            if time.monotonic() > self.deadline:
                raise TemplateLimit(f"it runs longer than {MAX_TEMPLATE_SECONDS:g} s")
            for v in frame.f_locals.values():
                _check_result("a variable", _sized(v))
        return self.line


def template_file(tokenizer) -> str:
    """Where `tokenizer`'s chat template comes from, for messages: its folder's chat_template.jinja,
    chat_template.json or tokenizer_config.json."""
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or "."))
    for name in ("chat_template.jinja", "chat_template.json"):
        if (folder / name).is_file():
            return str(folder / name)
    return str(folder / "tokenizer_config.json")


def render_chat(tokenizer, prompt: str, where: str | None = None) -> str:
    """`prompt` as one user turn in `tokenizer`'s chat template, with the generation prompt; bounded (see the
    module's docstring), refused with a UserError naming the template's file (`where` overrides it)."""
    where = where or template_file(tokenizer)
    source = tokenizer.chat_template
    if isinstance(source, dict):  # named templates: transformers uses "default"
        source = source.get("default")
    try:
        if not isinstance(source, str):
            raise TemplateLimit("it is not one text")
        if len(source) > MAX_TEMPLATE_SOURCE:
            raise TemplateLimit(f"it is {len(source):,} characters long (at most {MAX_TEMPLATE_SOURCE:,})")
        template = _compile(source)
        special = {k: v for k, v in (getattr(tokenizer, "special_tokens_map", None) or {}).items()}
        tracer, previous = _Tracer(), sys.gettrace()
        out, size = [], 0
        sys.settrace(tracer)
        try:
            for chunk in template.generate(messages=[{"role": "user", "content": prompt}], tools=None, documents=None,
                                           add_generation_prompt=True, **special):  # as transformers renders
                size += len(chunk)
                _check_result("its output", size)
                out.append(chunk)
        finally:
            sys.settrace(previous)
        return "".join(out)
    except TemplateLimit as e:
        raise UserError(f"{where}: its chat template is refused ({e}); run without --chat-template, or fix the "
                        "template.") from None
    except Exception as e:  # Jinja's errors, the sandbox's refusals, OverflowError, RecursionError, ...
        why = (str(e).splitlines() or [""])[0][:120]
        raise UserError(f"{where}: its chat template cannot be rendered ({type(e).__name__}: {why}); run "
                        "without --chat-template, or fix the template.") from None
