"""ddp_lib.apps.mfu: the model-FLOP count against torch's FlopCounterMode, the peaks, the memory timeline."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ddp_lib.apps import mfu


def _tiny_llama(layers: int = 2, tied: bool = False):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(hidden_size=48, intermediate_size=112, num_hidden_layers=layers, num_attention_heads=6,
                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, pad_token_id=0,
                      num_labels=2, tie_word_embeddings=tied)
    cfg._attn_implementation = "eager"  # attention as matmuls, which FlopCounterMode counts on the CPU
    torch.manual_seed(0)
    return LlamaForSequenceClassification(cfg)


@pytest.mark.parametrize("batch,seq", [(3, 11), (2, 32)])
def test_training_flops_equal_what_torch_counts_for_forward_and_backward(batch, seq):
    model = _tiny_llama()
    ids = torch.randint(1, 97, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=torch.zeros(batch, dtype=torch.long)).loss.backward()
    counted = counter.get_total_flops()
    assert mfu.training_flops(model, [(batch, seq)]) == counted
    # the attention term matters: 6N alone misses it by 12·L·H·Q·T per token
    n = mfu.matmul_params(model)
    assert counted - 6 * n * batch * seq == 12 * 2 * 6 * 8 * seq * batch * seq


def test_micro_batches_add_up_and_the_counted_n_is_the_linear_weights():
    model = _tiny_llama(layers=3)
    embed = model.model.embed_tokens.weight.numel()
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert mfu.matmul_params(model) == sum(p.numel() for p in model.parameters()) - embed - norms
    assert mfu.training_flops(model, [(2, 5), (4, 7)]) == (mfu.training_flops(model, [(2, 5)])
                                                          + mfu.training_flops(model, [(4, 7)]))
    assert mfu.attention_shape(model.config) == (3, 6, 8)


def test_cpu_matmul_peak_is_a_plausible_rate():
    peak = mfu.cpu_matmul_peak(n=256, repeats=3)
    assert 1e8 < peak < 1e14  # between 0.1 GFLOP/s and 100 TFLOP/s on any CPU


def test_gpu_peaks_by_name_and_dtype(monkeypatch):
    names = iter(["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "Tesla T4", "Tesla T4", "NVIDIA GeForce RTX 4090"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: next(names))
    assert mfu.gpu_datasheet_peak("cuda:0", torch.bfloat16)[0] == pytest.approx(989.5e12)
    assert mfu.gpu_datasheet_peak("cuda:0", torch.float32)[0] == pytest.approx(51e12)
    assert mfu.gpu_datasheet_peak("cuda:1", torch.float32)[0] == pytest.approx(8.1e12)
    peak, why = mfu.gpu_datasheet_peak("cuda:1", torch.bfloat16)  # a T4 has no bf16 row: no guess
    assert peak is None and "T4" in why
    assert mfu.gpu_datasheet_peak("cuda:0", torch.float32)[0] is None  # not in the table


@pytest.mark.parametrize("name, bf16_tflops, tf32_tflops, fp32_tflops", [
    ("NVIDIA A100-SXM4-40GB", 312.0, 156.0, 19.5), ("NVIDIA A100 80GB PCIe", 312.0, 156.0, 19.5),
    ("NVIDIA H200", 989.5, 494.5, 67.0), ("NVIDIA H200 NVL", 835.5, 417.5, 60.0),
    ("NVIDIA H100 NVL", 835.5, 417.5, 60.0), ("NVIDIA H100 80GB HBM3", 989.5, 494.5, 67.0),
    ("NVIDIA H100 PCIe", 756.5, 378.0, 51.0), ("NVIDIA L4", 121.0, 60.0, 30.3)])
def test_the_datasheet_peaks_of_the_boxes_learners_rent(monkeypatch, name, bf16_tflops, tf32_tflops, fp32_tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert mfu.gpu_datasheet_peak("cuda:0", torch.bfloat16)[0] == pytest.approx(bf16_tflops * 1e12)
    assert mfu.gpu_datasheet_peak("cuda:0", "tf32")[0] == pytest.approx(tf32_tflops * 1e12)
    assert mfu.gpu_datasheet_peak("cuda:0", torch.float32)[0] == pytest.approx(fp32_tflops * 1e12)


def test_a_t4_has_no_tf32_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    peak, why = mfu.gpu_datasheet_peak("cuda:0", "tf32")
    assert peak is None and "tf32" in why


def test_bf16_only_from_sm80(monkeypatch):
    assert mfu.bf16_native("cpu")[0] is False
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    ok, why = mfu.bf16_native("cuda:0")
    assert not ok and "sm_75" in why and "emulated" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert mfu.bf16_native("cuda:0")[0] is True


def test_memory_timeline_follows_allocs_and_completed_frees():
    snap = {"device_traces": [[{"action": "segment_alloc", "size": 2 << 20}, {"action": "alloc", "size": 512},
                               {"action": "alloc", "size": 1024}, {"action": "free_requested", "size": 512},
                               {"action": "free_completed", "size": 512}]]}
    assert mfu.memory_timeline(snap) == [512, 1536, 1024]


def test_a_snapshot_is_skipped_with_its_reason_where_there_is_no_cuda_allocator():
    assert "CPU" in mfu.snapshot_skip_reason("cpu")
    if not hasattr(torch._C, "_cuda_record_memory_history"):  # this CPU build, or the simulated GPU box
        assert "CPU build" in mfu.snapshot_skip_reason("cuda:0")


def test_gpt2s_conv1d_projections_count_as_linear_layers():
    """GPT-2's attention and MLP projections are transformers' Conv1D, not nn.Linear: counted all the same."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=48, n_layer=2, n_head=4, vocab_size=97, n_positions=32)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 97, (2, 16))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    assert mfu.training_flops(model, [(2, 16)]) == counter.get_total_flops()

