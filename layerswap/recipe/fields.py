"""The recipe's fields: one table from which every way of giving a recipe is read and checked.

Each `Field` says what a value is (whole number, number, choice, list of numbers, layer list), its bounds,
where it lands (a `Plan` attribute, a `MethodConfig` parameter, or both), and its names: the
`Recipe.from_values` keyword, the CLI flag, and the key in the app's share links (whose order is the order
of the app's plan controls, `LINK_KEYS`). From the table come the CLI's plan and method flags
(`cli.options`), the share-link keys and their parsing (`ui.controls`), `Recipe.from_values`, and the
recipe and sweep file keys (`PLAN_FILE_KEYS`, `METHOD_PARAMS`). Every loose value goes through
`Field.read`, which refuses what is out of bounds before anything is expanded.

Adding a plan option is one entry here plus its meaning in `Plan` (and, for the app, its control).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from layerswap.core.bounds import MAX_LAYERS, UNIT, Range
from layerswap.core.errors import UserError, whole_number
from layerswap.recipe.methods import METHODS, PARAM_RANGES
from layerswap.recipe.plans import KINDS, MODULES, NON_LAYER_OPTIONS, TRANSITIONS, parse_layers

_NUMBER_CHARS = 32  # the longest text one number is read from
_WORDS = {2: "two"}


@dataclass(frozen=True)
class Field:
    """One value of a recipe. `plan` / `method`: the Plan attribute / MethodConfig parameter it sets (the
    key in recipe files); `key`: its share-link key; `flag`: its CLI flag (`dest` its argparse name)."""

    name: str
    kind: str  # int, float, choice, floats, layers
    help: str
    group: str  # the CLI option group: plan, maps, method
    key: str = ""
    flag: str = ""
    plan: str | None = None
    method: str | None = None
    bounds: Range | None = None
    choices: tuple[str, ...] | None = None
    size: int | None = None  # floats: exactly this many
    max_len: int = MAX_LAYERS  # floats, layers: at most this many
    metavar: str | None = None
    label: str = ""  # how messages name it (default: the name with spaces)

    @property
    def what(self) -> str:
        return self.label or self.name.replace("_", " ")

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_") if self.flag != "--lambda" else "lam"

    @property
    def max_chars(self) -> int:
        """The longest text this value is read from (share links, CLI, app)."""
        return _NUMBER_CHARS * (self.size or self.max_len) if self.kind in ("floats", "layers") else _NUMBER_CHARS

    def read(self, value: Any, num_layers: int | None = None) -> Any:
        """A loose value (CLI text, slider float, share-link text, file value) as the recipe takes it, checked
        against the bounds (layer lists against `num_layers` when the model is known); None for "not given"
        (None or empty text)."""
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        if isinstance(value, str) and len(value) > self.max_chars:
            raise UserError(f"{self.what} is at most {self.max_chars:,} characters long (got {len(value):,}).")
        if self.kind == "choice":
            if value not in self.choices:
                raise UserError(f"{self.what} must be one of {', '.join(self.choices)} (got {value!r:.40}).")
            return value
        if self.kind == "layers":
            out = parse_layers(value, num_layers)
            if len(out) > self.max_len:
                raise UserError(f"{self.what} names at most {self.max_len} layers (got {len(out)}).")
            return out
        if self.kind == "floats":
            return self._floats(value)
        if self.kind == "int":
            return whole_number(value, self.what, int(self.bounds.lo), int(self.bounds.hi))
        x = _number(value, self.what)
        self.bounds.check(x, self.what)
        return x

    def _floats(self, value: Any) -> tuple[float, ...]:
        if isinstance(value, str):
            value = [x for x in value.replace(" ", "").split(",") if x]
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{self.what}: comma-separated numbers, e.g. 1,1 (got {value!r:.40}).")
        if self.size is not None and len(value) != self.size:
            n = _WORDS.get(self.size, str(self.size))
            raise UserError(f"{self.what} take {n} numbers, {self.metavar} (got {len(value)}).")
        if len(value) > self.max_len:
            raise UserError(f"{self.what}: at most {self.max_len} numbers (got {len(value)}).")
        out = tuple(_number(x, self.what) for x in value)
        for x in out:
            self.bounds.check(x, self.what)
        return out


def _number(value: Any, what: str) -> float:
    """A finite number from a number or its text."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise UserError(f"{what} is a number (got {value!r:.40}).")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise UserError(f"{what} is a number (got {value!r:.40}).") from None
    if not math.isfinite(x):
        raise UserError(f"{what} is a finite number (got {value!r:.40}).")
    return x


COUNT = Range(0, MAX_LAYERS)
# In the order of the app's plan controls (the share links' and the page's inputs' order).
FIELDS: tuple[Field, ...] = (
    Field("b", "int", "bottom layers taken from the language expert", "plan", "b", "--b", plan="b", bounds=COUNT),
    Field("u", "int", "top layers taken from the language expert", "plan", "u", "--u", plan="u", bounds=COUNT),
    Field("tb", "int", "bottom transition layers (blends)", "plan", "tb", "--tb", plan="tb", bounds=COUNT),
    Field("tu", "int", "top transition layers (blends)", "plan", "tu", "--tu", plan="tu", bounds=COUNT),
    Field("transition", "choice", "flat: every transition layer uses --transition-weight; ramp: linear steps "
          "(default flat)", "plan", "transition", "--transition", plan="transition", choices=TRANSITIONS),
    Field("transition_weight", "float", "language-expert weight of flat transition layers (default 0.5)", "plan",
          "tw", "--transition-weight", plan="transition_weight", bounds=UNIT, metavar="W"),
    Field("non_layer", "choice", "embeddings / final norm / lm_head: neighbour (embeddings follow layer 0, norm and "
          "lm_head follow the last layer), math, lang or avg (default neighbour)", "plan", "non_layer", "--non-layer",
          plan="non_layer", choices=NON_LAYER_OPTIONS),
    Field("kind", "choice", "swap (b/u/tb/tu, default), weights (--layer-weights), middle / random (--map-k), "
          "alternating", "maps", "kind", "--map", plan="kind", choices=KINDS, label="layer map"),
    Field("layer_weights", "floats", "language-expert weight of every layer (--map weights)", "maps", "weights",
          "--layer-weights", plan="weights", bounds=UNIT, metavar="W0,W1,..."),
    Field("k", "int", "number of layers from the language expert (--map middle/random)", "maps", "k", "--map-k",
          plan="k", bounds=COUNT),
    Field("seed", "int", "seed for --map random and DARE (default 0)", "maps", "seed", "--seed", plan="seed",
          method="seed", bounds=Range(0, 2**63 - 1)),
    Field("offset", "int", "first language layer (--map alternating; default 0)", "maps", "offset", "--offset",
          plan="offset", bounds=Range(0, 1)),
    Field("modules", "choice", "apply the map to attention only or MLP only; the rest stays with the math expert "
          "(default all)", "maps", "modules", "--modules", plan="modules", choices=MODULES),
    Field("method", "choice", "default layer_swap", "method", "method", "--method", choices=tuple(METHODS),
          label="merge method"),
    Field("weight", "float", "soup: language expert's share (default 0.5)", "method", "weight", "--weight",
          method="weight", bounds=PARAM_RANGES["weight"]),
    Field("lam", "float", "task-vector scale (default 1.0)", "method", "lam", "--lambda", method="lam",
          bounds=PARAM_RANGES["lam"], label="lambda", metavar="LAMBDA"),
    Field("density", "float", "TIES: fraction of each task vector kept (default 0.2)", "method", "density",
          "--density", method="density", bounds=PARAM_RANGES["density"]),
    Field("drop_rate", "float", "DARE: drop probability (default 0.9)", "method", "drop_rate", "--drop-rate",
          method="drop_rate", bounds=PARAM_RANGES["drop_rate"]),
    Field("expert_weights", "floats", "task arithmetic / TIES / DARE: weights of the math and language task "
          "vectors (default 1,1)", "method", "expert_weights", "--expert-weights",
          method="expert_weights", bounds=PARAM_RANGES["expert_weights"], size=2, metavar="WM,WL"),
    Field("revert", "layers", "layers taken from the base model instead (their fine-tuning reverted), e.g. 3-4,7; "
          "needs --base", "maps", "revert", "--revert", plan="revert", metavar="LAYERS", label="revert"),
)
BY_NAME = {f.name: f for f in FIELDS}
LINK_KEYS = tuple(f.key for f in FIELDS)
PLAN_FILE_KEYS = tuple(f.plan for f in FIELDS if f.plan)  # a recipe file's plan keys
METHOD_PARAMS = tuple(f.method for f in FIELDS if f.method)  # every method parameter a recipe file may give


def read_values(values: dict[str, Any], num_layers: int | None = None) -> dict[str, Any]:
    """Loose values by field name, each read through its field (layer lists against `num_layers` when the
    model is known); unknown names are refused."""
    unknown = sorted(set(values) - set(BY_NAME))
    if unknown:
        raise UserError(f"Unknown recipe value{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; a recipe "
                        f"takes {', '.join(BY_NAME)}.")
    return {k: BY_NAME[k].read(v, num_layers) for k, v in values.items()}
