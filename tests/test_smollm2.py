"""ddp_lib.apps.smollm2 offline: the announced random fallback, the SmolLM2 shapes and the BPE tokenizer."""

import pytest
import torch

from ddp_lib.apps.smollm2 import (SMOLLM2_360M, SPECIAL_TOKENS, load_smollm2, random_smollm2, smollm2_config,
                             train_pair_tokenizer)


@pytest.fixture(scope="module")
def tok():
    return train_pair_tokenizer(vocab_size=500)


def test_random_fallback_is_announced(capsys):
    from transformers import LlamaForSequenceClassification

    model, tokenizer = load_smollm2(vocab_size=500, packaged=False)
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "SmolLM2-135M-Instruct unavailable" in err  # a CPU asks for the 135M
    assert "RANDOMLY INITIALISED" in err and "'small' shape" in err and "no pretrained weights" in err
    assert isinstance(model, LlamaForSequenceClassification) and model.ddp_lib_source == "random-small"
    c = model.config
    assert c.num_attention_heads == 3 * c.num_key_value_heads and c.num_labels == 2
    assert c.pad_token_id == tokenizer.pad_token_id == 2 and c.vocab_size == len(tokenizer)
    assert c.id2label == {0: "not_equivalent", 1: "equivalent"}


def test_ddp_smollm2_random_skips_the_hub_and_the_packaged_model(monkeypatch, capsys):
    from ddp_lib.apps import smollm2

    def forbidden(*a, **k):
        raise AssertionError("DDP_SMOLLM2=random must not reach the Hub or the packaged model")
    monkeypatch.setenv(smollm2.RANDOM_ENV, "random")
    for name in ("hub_reachable", "_pretrained", "_packaged", "packaged_snapshot"):
        monkeypatch.setattr(smollm2, name, forbidden)
    assert smollm2.prepare_smollm2() == "none"
    model, _ = load_smollm2(vocab_size=500)  # packaged=True, the lesson's call
    assert model.ddp_lib_source == "random-small"
    assert "(DDP_SMOLLM2=random)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="fallback=False"):
        load_smollm2(fallback=False)


def test_fallback_can_be_refused():
    with pytest.raises(OSError):
        load_smollm2(fallback=False, packaged=False)


def test_full_shape_is_smollm2_360m():
    from transformers import LlamaForSequenceClassification

    c = smollm2_config("full")
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (960, 2560, 32)
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (15, 5, 49152)
    assert c.rope_parameters["rope_theta"] == SMOLLM2_360M["rope_theta"] == 1e5 and c.tie_word_embeddings
    with torch.device("meta"):  # the shape without allocating 1.4 GB
        n = sum(p.numel() for p in LlamaForSequenceClassification(c).parameters())
    assert n == 361_821_120 + 960 * 2  # SmolLM2-360M's published count + the 2-label score head
    with pytest.raises(ValueError):
        smollm2_config("medium")


def test_tokenizer_has_smollm2_specials_and_a_pair_template(tok):
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert tok.pad_token == "<|im_end|>" and tok.pad_token_id == 2
    a, b = "Marta Ruiz signed the deal.", "The deal was signed by Marta Ruiz."
    ids = tok(a, b)["input_ids"]
    assert ids.count(0) == 2 and ids[-1] == 0  # separator after each sentence, none elsewhere
    sep = ids.index(0)
    assert tok.decode(ids[:sep]) == a and tok.decode(ids[sep + 1:-1]) == b
    assert tok.decode(ids) == f"{a}<|endoftext|>{b}<|endoftext|>"
    short = tok(a, b, truncation=True, max_length=10)["input_ids"]
    assert len(short) == 10 and short[-1] == 0 and short.count(0) == 2
    assert "token_type_ids" not in tok(a, b)


def test_same_seed_same_model_and_it_trains(tok):
    m1, m2 = random_smollm2(vocab_size=len(tok), seed=4), random_smollm2(vocab_size=len(tok), seed=4)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))
    enc = tok(["a b c", "a longer first sentence"], ["c", "d e"], padding=True, return_tensors="pt")
    out = m1(**enc, labels=torch.tensor([0, 1]))
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.logits.shape == (2, 2)
    assert all(p.grad is not None for p in m1.parameters())


def test_a_bf16_checkpoint_loads_in_fp32_unless_asked(tok, tmp_path):
    # transformers 5 reads dtype=None as "auto" (the checkpoint's dtype): SmolLM2-360M's is bf16, where an lr of
    # 5e-5 rounds most updates away; load_smollm2 asks for fp32 unless given a dtype
    random_smollm2(vocab_size=len(tok), seed=1, dtype=torch.bfloat16).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model, _ = load_smollm2(model_id=str(tmp_path), fallback=False, verbose=False)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    half, _ = load_smollm2(model_id=str(tmp_path), fallback=False, verbose=False, dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
