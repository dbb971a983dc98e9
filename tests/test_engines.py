from __future__ import annotations

import pytest

from layerswap import UserError
from layerswap.demo import build_tokenizer, make_tiny_llama
from layerswap.engines import Engine, TransformersEngine


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


def test_chat_template_used_when_present(tmp_path):
    tok = build_tokenizer(chat_template="{% for m in messages %}<s>USER: {{ m['content'] }}\n{% endfor %}ASSISTANT:")
    d = make_tiny_llama(tmp_path / "chat", layers=2, tokenizer=tok)
    eng = TransformersEngine.from_pretrained(d)
    assert eng.use_chat_template and eng.format("2+2?") == "<s>USER: 2+2?\nASSISTANT:"
    assert len(eng.generate(["2+2?"], max_new_tokens=4)) == 1
    plain = TransformersEngine.from_pretrained(d, use_chat_template=False)
    assert plain.format("2+2?") == "2+2?"


def test_chat_template_missing(trio):
    with pytest.raises(UserError, match="no chat template"):
        TransformersEngine.from_pretrained(trio["math"], use_chat_template=True)


def test_stop_strings_work_with_a_word_level_tokenizer():
    """transformers' own stop_strings fail on word-level vocabularies (the demo organism's); ours decode the tail."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from layerswap.engines import _StopOnText

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
    stop = _StopOnText(tok, ["Question:", "Sorvi:"], len(prompt))
    assert stop(ids, None).tolist() == [True, False, True]
    assert _StopOnText(tok, ["Question:"], len(prompt) + 3)(ids, None).tolist() == [False, False, False]
