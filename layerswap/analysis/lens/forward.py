"""Forward passes that hand every layer's hidden states to a callback, in memory or streamed block by block.

A `Stack` runs the model's own transformers code: its embedding module, its base model's
``forward`` (rotary embeddings, causal and sliding-window masks, per-layer attention types, the
KV cache) and its own decoder-layer modules, final norm and ``lm_head``. Forward hooks on the
decoder layers report each layer's output; nothing of the architecture is re-implemented.

- `Stack.loaded(model)`: a transformers model already in memory (any device).
- `Stack.streamed(source)`: the same classes built on the meta device; a forward pre-hook loads
  layer ``i``'s weights from the safetensors files (`WeightSource`) just before the block runs and
  the forward hook puts them back on the meta device after it, so one block is resident at a time
  while the batch's hidden states are carried from block to block. Only the rows of the
  embedding matrix the batch uses are read, and ``lm_head`` is read in row slices when decoding.

Layer numbering: state 0 is the embedding output (the input of block 0), state ``i`` the output
of block ``i - 1``, state ``L`` the last block's output before the final norm.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Callable, Sequence

from layerswap.models.architectures import LAYER_RE
from layerswap.models.checkpoints import Checkpoint
from layerswap.core.errors import UserError
from layerswap.merge.merging import merge_in_memory
from layerswap.recipe.recipes import Recipe, as_recipe
from layerswap.recipe.plans import Plan

if TYPE_CHECKING:
    import torch

OnLayer = Callable[[int, "torch.Tensor"], None]  # (state index 0..L, hidden states B x T x H)
OnBlock = Callable[[int], None]  # called before block i runs (progress, cancellation)
HEAD_SLICE_BYTES = 64 * 2**20  # lm_head rows read at a time when streaming


class WeightSource:
    """One model's tensors, read from safetensors when a block (or some rows) is needed."""

    def __init__(self, ck: Checkpoint):
        self.ck = ck
        self.num_layers = ck.num_layers
        by_type: dict[str, list[str]] = {}
        for t in ck.tensors.values():
            by_type.setdefault(t.ptype, []).append(t.name)
        vocab = int(ck.text_config.get("vocab_size") or 0)
        embeds = sorted(by_type.get("embed", []), key=lambda n: ck.tensors[n].shape[0] != vocab)
        if not embeds:
            raise UserError(f"{ck.ref}: no embedding tensor found; the lens needs a decoder-only language model.")
        self.embed_name = embeds[0]
        heads = [n for n in by_type.get("lm_head", []) if n.endswith("weight")]
        self.head_name = (heads or [self.embed_name])[0]  # tied embeddings: the embedding matrix
        self.norm_names = by_type.get("final_norm", [])
        self.layer_names = {i: [t.name for t in ck.layer_tensors(i)] for i in range(self.num_layers)}

    @property
    def dtype(self) -> "torch.dtype":
        return self.ck.tensors[self.embed_name].torch_dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self.ck.tensors[name].shape

    def tensors(self, names: Sequence[str]) -> dict[str, "torch.Tensor"]:
        return {n: self.ck.read(n) for n in names}

    def rows(self, name: str, start: int, count: int) -> "torch.Tensor":
        cols = self.shape(name)[1]
        return self.ck.read(name, start * cols, count * cols).reshape(count, cols)

    def layer(self, i: int) -> dict[str, "torch.Tensor"]:
        """Block `i`'s tensors keyed as the decoder-layer module names them (``self_attn.q_proj.weight``)."""
        return {LAYER_RE.search(n).group(2): t for n, t in self.tensors(self.layer_names[i]).items()}

    def norm(self) -> dict[str, "torch.Tensor"]:
        return {n.rsplit(".", 1)[-1]: t for n, t in self.tensors(self.norm_names).items()}

    def rows_at(self, name: str, ids: Sequence[int]) -> "torch.Tensor":
        import torch

        return torch.cat([self.rows(name, int(i), 1) for i in ids])

    @property
    def nbytes(self) -> int:
        return self.ck.nbytes


class MergedSource(WeightSource):
    """The merge of a recipe, block by block: each block's tensors come from `merging.merge_in_memory`
    on that block's tensors of both experts (and the base when the recipe needs it)."""

    def __init__(self, math: Checkpoint, lang: Checkpoint, recipe: Recipe | Plan, base: Checkpoint | None = None):
        super().__init__(math)
        self.lang, self.base, self.recipe = lang, base, as_recipe(recipe)
        self.recipe.validate(math.num_layers)
        self.recipe.require_base(base is not None)
        # an elementwise recipe can merge any rows alone; TIES/DARE need whole tensors
        self.by_rows = self.recipe.plan is not None or self.recipe.method.spec.chunkable
        self._whole: dict[str, "torch.Tensor"] = {}

    def _merge(self, read: Callable[[Checkpoint, str], "torch.Tensor"], names: Sequence[str]) -> dict:
        base = self.base
        return merge_in_memory({n: read(self.ck, n) for n in names}, {n: read(self.lang, n) for n in names},
                               self.num_layers, self.recipe,
                               base=(lambda n: read(base, n)) if base is not None else None, arch=self.ck.arch)

    def tensors(self, names: Sequence[str]) -> dict[str, "torch.Tensor"]:
        return self._merge(lambda ck, n: ck.read(n), names)

    def rows(self, name: str, start: int, count: int) -> "torch.Tensor":
        cols = self.shape(name)[1]
        if self.by_rows:
            return self._merge(lambda ck, n: ck.read(n, start * cols, count * cols).reshape(count, cols), [name])[name]
        if name not in self._whole:
            self._whole[name] = self.tensors([name])[name]
        return self._whole[name][start:start + count]


def _to_meta(module) -> None:
    """Drop a block's weights (parameters back on the meta device); buffers stay."""
    import torch

    for m in module.modules():
        for k, p in m._parameters.items():
            if p is not None and p.device.type != "meta":
                m._parameters[k] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                      requires_grad=False)


def _assign(module, state: dict, what: str) -> None:
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    params = {n for n, _ in module.named_parameters()}
    missing = [m for m in missing if m in params]
    if missing or unexpected:
        raise UserError(f"{what}: the checkpoint's tensors do not fit the model class (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}).")


class Stack:
    """A causal LM the lens runs layer by layer; weights resident (`loaded`) or streamed (`streamed`)."""

    def __init__(self, model, source: WeightSource | None = None, device: str = "cpu"):
        import torch

        self.model, self.source = model, source
        self.prefix: "torch.Tensor | None" = None  # a prefix-tuning expert's prefix table (`with_prefix`)
        self.base = model.base_model
        self.config = model.config
        self.layers = list(self.base.layers)[: self.config.num_hidden_layers]
        self.device = torch.device(device)
        if source is None:
            p = next(model.parameters())
            self.device, self.dtype = p.device, p.dtype
        else:
            self.dtype = source.dtype
            for m in model.modules():  # rotary tables, embedding scales: small, real
                for k, b in m._buffers.items():
                    if b is not None:
                        m._buffers[k] = b.to(self.device)
            _assign(self.base.norm, {k: t.to(self.device) for k, t in source.norm().items()}, "final norm")

    @classmethod
    def loaded(cls, model) -> "Stack":
        return cls(model.eval())

    @classmethod
    def streamed(cls, source: WeightSource, device: str = "cpu") -> "Stack":
        """The model's classes on the meta device, weights read from `source` block by block."""
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(source.ck.path))
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config)
        return cls(model.eval(), source, device)

    def with_prefix(self, table: "torch.Tensor | None") -> "Stack":
        """Run with a prefix-tuning prefix in every layer's attention (as peft runs it); None: without."""
        self.prefix = table
        return self

    def _prefixed(self, batch: int, cache=None):
        """`cache` (or a new one) holding the prefix's keys and values for `batch` rows."""
        from layerswap.models.adapters import prefix_kv

        cache = cache if cache is not None else self.new_cache(prefixed=False)
        heads = getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads
        for i in range(self.num_layers):
            k, v = prefix_kv(self.prefix, i, self.num_layers, heads)
            cache.update(*(t.expand(batch, -1, -1, -1).to(self.device, self.dtype) for t in (k, v)), i)
        return cache

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def vocab_size(self) -> int:
        if self.source is not None:
            return self.source.shape(self.source.head_name)[0]
        return self.model.get_output_embeddings().weight.shape[0]

    def embed(self, ids: "torch.Tensor") -> "torch.Tensor":
        """The model's embedding module applied to `ids` (streamed: a copy holding only the rows used)."""
        import torch

        ids = ids.to(self.device)
        if self.source is None:
            return self.base.embed_tokens(ids)
        uniq, inverse = torch.unique(ids, return_inverse=True)
        emb = copy.deepcopy(self.base.embed_tokens)
        emb._parameters["weight"] = torch.nn.Parameter(
            self.source.rows_at(self.source.embed_name, uniq.tolist()).to(self.device), requires_grad=False)
        emb.padding_idx, emb.num_embeddings = None, len(uniq)
        return emb(inverse)

    def forward(self, ids: "torch.Tensor", mask: "torch.Tensor | None", on_layer: OnLayer, *,
                cache=None, on_block: OnBlock | None = None) -> None:
        """Run the model's own forward on `ids`; `on_layer(i, states)` gets every state 0..L.

        `mask`: the 2-D attention mask (1 = token, 0 = padding); `cache`: a transformers cache to
        generate with. `on_block(i)` runs before block i (it may raise to stop the pass).
        """
        import torch

        hooks = []

        def pre(i: int):
            def hook(module, args, kwargs):
                if on_block is not None:
                    on_block(i)
                if self.source is not None:
                    _assign(module, {k: t.to(self.device) for k, t in self.source.layer(i).items()}, f"layer {i}")
            return hook

        def post(i: int):
            def hook(module, args, kwargs, out):
                on_layer(i + 1, out[0] if isinstance(out, tuple) else out)
                if self.source is not None:
                    _to_meta(module)
            return hook

        with torch.inference_mode():
            emb = self.embed(ids)
            on_layer(0, emb)
            if self.prefix is not None and cache is None:  # a prefix: every token also attends to it
                cache = self._prefixed(ids.shape[0])
                if mask is not None:
                    mask = torch.cat([mask.new_ones(mask.shape[0], self.prefix.shape[0]), mask], 1)
            try:
                for i, layer in enumerate(self.layers):
                    hooks.append(layer.register_forward_pre_hook(pre(i), with_kwargs=True))
                    hooks.append(layer.register_forward_hook(post(i), with_kwargs=True))
                self.base(inputs_embeds=emb, attention_mask=None if mask is None else mask.to(self.device),
                          past_key_values=cache, use_cache=cache is not None)
            finally:
                for h in hooks:
                    h.remove()
                if self.source is not None:
                    for layer in self.layers:
                        _to_meta(layer)

    def decode(self, states: "torch.Tensor") -> "torch.Tensor":
        """Logits (float32, N x V) of states (N x H) through the model's final norm and lm_head, with the
        model's final-logit soft-capping when its config has one (Gemma 2/3), as its own forward does."""
        import torch

        with torch.inference_mode():
            x = self.base.norm(states.to(self.device, self.dtype))
            if self.source is None:
                logits = self.model.get_output_embeddings()(x)
            else:
                name = self.source.head_name
                vocab, cols = self.source.shape(name)
                step = max(1, HEAD_SLICE_BYTES // (cols * x.element_size()))
                logits = torch.cat([torch.nn.functional.linear(x, self.source.rows(name, s, min(step, vocab - s))
                                                               .to(self.device)) for s in range(0, vocab, step)], -1)
            cap = getattr(self.config, "final_logit_softcapping", None)
            if cap:
                logits = torch.tanh(logits / cap) * cap
            return logits.float()

    def new_cache(self, prefixed: bool = True):
        """A cache to generate with (holding the prefix, for one row, when the model has one)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        return self._prefixed(1, cache) if prefixed and self.prefix is not None else cache
