"""The honest floor of `benchmarks.step_floor`: the weight bytes a decode step reads (exact counts from the
shapes, written out here), the experts a cell's steps read, the copy rate's median of timed copies, the kernels a
step launches by name."""

import pytest
import torch

from torch.profiler import ProfilerActivity, profile

from benchmarks.step_floor import (ATTENTION_SHARPEN, copy_rate, decode_config, experts_read, kernel_table,
                                   random_model, shape_config, step_bytes)
from mbd.config import EngineConfig
from mbd.decoding import Engine
from mbd.model.llada2_moe import LLaDA2Gate


def layer_attention(c) -> int:
    """Elements of a layer's attention and its two norms: q|k|v, output projection, q/k norms."""
    return c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim \
        + c.num_attention_heads * c.head_dim * c.hidden_size + 2 * c.head_dim + 2 * c.hidden_size


def test_a_dense_step_reads_its_rows_of_the_input_embedding_and_the_whole_head():
    cfg = shape_config("tiny", 4)
    model = random_model(cfg, "cpu", torch.float32)
    d, v, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    layer = layer_attention(cfg) + 3 * d * cfg.intermediate_size
    assert step_bytes(model, rows_read=8) == 4 * (L * layer + d + v * d + 8 * d)
    assert step_bytes(model, rows_read=10 * v) == 4 * (L * layer + d + 2 * v * d)  # no more rows than the table


def test_a_tied_head_is_counted_once_as_the_head():
    cfg = shape_config("tiny", 4).model_copy(update={"tie_word_embeddings": True})
    model = random_model(cfg, "cpu", torch.float32)
    assert model.lm_head.weight is model.model.embedding.weight
    d, v, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    layer = layer_attention(cfg) + 3 * d * cfg.intermediate_size
    assert step_bytes(model, rows_read=8) == 4 * (L * layer + d + v * d)


def test_the_moe_step_reads_the_experts_its_tokens_chose():
    cfg = shape_config("tiny-moe", 4)
    model = random_model(cfg, "cpu", torch.float32).to(torch.bfloat16)  # the expert bias stays float32
    d, v, L, E, ff = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers, cfg.num_experts, cfg.moe_intermediate_size
    dense = L * layer_attention(cfg) + cfg.first_k_dense_replace * 3 * d * cfg.intermediate_size
    moe_layers = L - cfg.first_k_dense_replace
    shared = 3 * d * ff * cfg.num_shared_experts
    expert = 3 * d * ff
    fixed = 2 * (dense + moe_layers * (E * d + shared) + d + v * d + 8 * d) + 4 * moe_layers * E
    assert step_bytes(model, 8) == fixed + 2 * moe_layers * E * expert
    assert step_bytes(model, 8, {0: 5, 1: 16}) == fixed + 2 * (5 + 16) * expert


def test_experts_read_counts_the_distinct_experts_of_each_decode_step():
    """Routing fixed by the expert bias alone (router weights zero): every token of every step chooses the same
    k experts, so each MoE layer's steps read exactly k."""
    cfg = shape_config("tiny-moe", 4)
    model = random_model(cfg, "cpu", torch.float32)
    with torch.no_grad():
        for gate in (m for m in model.modules() if isinstance(m, LLaDA2Gate)):
            gate.weight.zero_()
            gate.expert_bias.copy_(torch.arange(cfg.num_experts) / 100)
    engine = Engine(model, None, decode_config(2, 4 * cfg.block_size), EngineConfig(device="cpu", max_batch_rows=2))
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]]
    k = cfg.num_experts_per_tok
    assert experts_read(model, engine, prompts) == {i: k for i in range(cfg.num_hidden_layers - 1)}
    assert "prefill" not in vars(engine.runner)  # the counting wrapper is gone


def test_the_copy_rate_is_the_median_of_the_timed_copies():
    times, copied = iter([5.0, 1.0, 3.0, 2.0, 4.0]), []

    def timer(fn) -> float:
        fn()
        copied.append(True)
        return next(times)

    assert copy_rate("cpu", 1000, repeats=5, timer=timer) == pytest.approx(2 * 1000 / 3.0)
    assert len(copied) == 5


def test_only_the_moe_gets_sharpened_attention_for_its_routing():
    norms = {}
    for shape in ("tiny", "tiny-moe"):
        model = random_model(shape_config(shape, 4), "cpu", torch.float32)
        norms[shape] = {float(p.detach().unique()) for n, p in model.named_parameters() if n.endswith(("q_norm.weight",
                        "k_norm.weight", "query_layernorm.weight", "key_layernorm.weight"))}
    assert norms == {"tiny": {1.0}, "tiny-moe": {ATTENTION_SHARPEN}}


def test_the_kernel_table_counts_each_kernel_per_step_and_ranks_them_by_time():
    """The same summary the GPU rows take of CUDA kernels, taken here of a CPU profile whose calls are known: 3
    steps of 2 large matmuls and 5 small adds."""
    a, b = torch.randn(256, 256), torch.randn(8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            for _ in range(2):
                torch.mm(a, a)
            for _ in range(5):
                torch.add(b, b)
    table = kernel_table(prof.key_averages(), "CPU", steps=3, top=2)
    (first, mm_calls, mm_us), (second, add_calls, _) = table["top"]
    assert (first, mm_calls) == ("aten::mm", 2) and mm_us > 0  # the matmuls take the most time
    assert second != "aten::mm" and len(table["top"]) == 2
    counts = {e.key: e.count for e in prof.key_averages()}
    assert table["per_step"] == sum(counts.values()) / 3
    assert counts["aten::add"] == 15
    assert table["us_step"] >= mm_us


def test_the_floor_row_reports_each_cells_kernels_by_name(monkeypatch, tmp_path):
    """The GPU-only part of the floor rows (kernels per layer, the kernels' share of the step, the top kernels by
    name) rendered from a kernel table handed in, as a CUDA profile would give it, on the quick CPU sizes."""
    import benchmarks.step_floor as step_floor
    from benchmarks.acceptance_rows import QUICK, floor_row

    top = [["gemm_kernel", 8.0, 900.0], ["triton_per_fused_add_rms_norm_0", 4.0, 40.0]]
    monkeypatch.setattr(step_floor, "kernels_per_step",
                        lambda *a: {"per_step": 18.0, "us_step": 1500.0, "top": top})
    row = floor_row(0)(QUICK, "cpu", tmp_path)
    layers = row.data["layers"]
    assert layers == shape_config("tiny", 4).num_hidden_layers
    assert all(c["kernels_layer"] == 18.0 / layers and c["device_ms_step"] == 1.5 for c in row.data["cells"])
    assert row.detail.count(f"{18.0 / layers:.1f} kernels/layer taking 1.50 ms of the step") == 4  # every cell
    assert f"gemm_kernel x{8.0 / layers:.2f} 900 us" in row.detail  # batch 1 SingleBD's top kernels
    lines = step_floor.table(row.data).splitlines()
    assert len(lines) == 3 + 4 + 4 and all(line.startswith("- top kernels, batch") for line in lines[-4:])
