"""Tensor-parallel sharding without processes: which heads, MLP columns and vocabulary rows each rank
holds, the start-up check naming config.json's fields, and each rank's slices read from a real
safetensors file against slicing the whole tensors."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conduit_engine.errors import ModelLoadError
from conduit_engine.models.architectures import read_arch_config
from conduit_engine.models.sharding import ShardPlan, check_tensor_parallel, read_shard
from tests.engine.support.model_factory import make_tiny_model

pytestmark = pytest.mark.unit


def test_stories_splits_over_two_and_four_ranks(stories_path):
    arch = read_arch_config(stories_path)  # 8 heads, 4 KV heads, intermediate 172, vocab 512
    for size in (1, 2, 4):
        check_tensor_parallel(arch, size)
    plan = ShardPlan.of(arch, 2, 1)
    assert (plan.local_heads, plan.local_kv_heads, plan.kv_replicas) == (4, 2, 1)
    assert plan.kv_head_range_of(1) == (2, 4)
    assert (plan.local_intermediate, plan.vocab_shard, plan.vocab_start, plan.vocab_rows) == (
        86,
        256,
        256,
        256,
    )
    local = plan.local_config(arch)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.head_dim) == (4, 2, 86, 8)


def test_a_size_that_does_not_divide_names_every_field(stories_path):
    arch = read_arch_config(stories_path)
    with pytest.raises(ModelLoadError) as err:
        check_tensor_parallel(arch, 3)
    assert str(err.value) == (
        "--tensor-parallel-size 3 does not fit the model's config.json: num_attention_heads (8) must be "
        "divisible by it; num_key_value_heads (4) must be divisible by it, or divide it (fewer KV heads "
        "than ranks are replicated); intermediate_size (172) must be divisible by it"
    )
    with pytest.raises(ModelLoadError, match=r"intermediate_size \(172\) must be divisible by it$"):
        check_tensor_parallel(arch, 8)  # 8 heads and 4 KV heads (replicated twice) would fit


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size"), [(4, 1, 2), (8, 2, 4), (8, 4, 2), (8, 8, 8), (6, 3, 3)]
)
def test_every_query_head_reads_its_kv_head_on_its_own_rank(heads, kv_heads, size):
    group = heads // kv_heads
    owners = []
    for rank in range(size):
        plan = ShardPlan(rank, size, heads, kv_heads, 8, 16 * size, 100)
        first_kv, end_kv = plan.kv_head_range_of(rank)
        assert end_kv - first_kv == plan.local_kv_heads
        for local_q in range(plan.local_heads):
            q = rank * plan.local_heads + local_q
            # The local grouped-query rule (local head // local group) finds the global KV head.
            assert first_kv + local_q // (plan.local_heads // plan.local_kv_heads) == q // group
        owners.append(first_kv)
    plan = ShardPlan(0, size, heads, kv_heads, 8, 16 * size, 100)
    assert [owners[r] for r in plan.kv_owner_ranks()] == list(range(0, kv_heads, plan.local_kv_heads))


def _checkpoint(tmp_path, tensors: dict[str, torch.Tensor]):
    path = tmp_path / "shard-test.safetensors"
    save_file(tensors, str(path))
    return path


def test_each_rank_reads_exactly_its_slices(tmp_path):
    # 4 heads of 2, 2 KV heads, intermediate 6, vocab 7 (odd: the last shard is padded), hidden 5.
    g = torch.Generator().manual_seed(0)
    full = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 5, generator=g),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(4, 5, generator=g),
        "model.layers.0.self_attn.v_proj.bias": torch.randn(4, generator=g),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(5, 8, generator=g),
        "model.layers.0.self_attn.o_proj.bias": torch.randn(5, generator=g),
        "model.layers.0.self_attn.qkv_proj.weight": torch.randn(16, 5, generator=g),
        "model.layers.0.mlp.gate_up_proj.weight": torch.randn(12, 5, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(5, 6, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(5, generator=g),
        "model.embed_tokens.weight": torch.randn(7, 5, generator=g),
    }
    path = _checkpoint(tmp_path, full)
    rank1 = ShardPlan(1, 2, 4, 2, 2, 6, 7)
    with safe_open(str(path), framework="pt") as f:
        read = {name: read_shard(rank1, name.removeprefix("model."), f.get_slice(name)) for name in full}
    layer = "model.layers.0."
    assert torch.equal(read[layer + "self_attn.q_proj.weight"], full[layer + "self_attn.q_proj.weight"][4:8])
    assert torch.equal(read[layer + "self_attn.k_proj.weight"], full[layer + "self_attn.k_proj.weight"][2:4])
    assert torch.equal(read[layer + "self_attn.v_proj.bias"], full[layer + "self_attn.v_proj.bias"][2:4])
    assert torch.equal(
        read[layer + "self_attn.o_proj.weight"], full[layer + "self_attn.o_proj.weight"][:, 4:8]
    )
    assert torch.equal(read[layer + "self_attn.o_proj.bias"], full[layer + "self_attn.o_proj.bias"])
    fused = full[layer + "self_attn.qkv_proj.weight"]  # q rows 0..8, k rows 8..12, v rows 12..16
    assert torch.equal(
        read[layer + "self_attn.qkv_proj.weight"], torch.cat((fused[4:8], fused[10:12], fused[14:16]))
    )
    gate_up = full[layer + "mlp.gate_up_proj.weight"]  # gate rows 0..6, up rows 6..12
    assert torch.equal(read[layer + "mlp.gate_up_proj.weight"], torch.cat((gate_up[3:6], gate_up[9:12])))
    assert torch.equal(read[layer + "mlp.down_proj.weight"], full[layer + "mlp.down_proj.weight"][:, 3:6])
    assert torch.equal(read[layer + "input_layernorm.weight"], full[layer + "input_layernorm.weight"])
    embed = read["model.embed_tokens.weight"]  # rows 4..7 and one row of zero padding
    assert embed.shape == (4, 5)
    assert torch.equal(embed[:3], full["model.embed_tokens.weight"][4:7]) and not embed[3].any()


def test_shards_of_a_real_checkpoint_fit_the_sharded_model(tmp_path):
    # The Llama layout with biases and an odd vocabulary (259): every slice has its parameter's shape.
    folder = make_tiny_model(
        tmp_path / "llama", num_heads=4, num_kv_heads=2, attention_bias=True, mlp_bias=True, seed=3
    )
    from conduit_engine.models.loader import load_model
    from conduit_engine.models.sharding import ModelShard
    from conduit_engine.ops.torch_ops import TorchOps

    arch = read_arch_config(folder)

    class NoComm:  # loading runs no collective
        rank, world_size = 1, 2

    plan = ShardPlan.of(arch, 2, 1)
    model = load_model(folder, arch, TorchOps(), torch.float32, "cpu", 64, ModelShard(plan, NoComm()))  # type: ignore[arg-type]
    assert model.embed_tokens.weight.shape == (130, 64)  # ceil(259 / 2) rows
    assert model.lm_head.weight.shape == (130, 64)
    assert not model.embed_tokens.weight[-1].any()  # rank 1 holds 129 real rows and one of padding
    attention = model.layers[0].self_attn
    assert attention.qkv_proj.weight.shape == (2 * 16 + 2 * 16, 64)  # 2 of 4 heads, 1 of 2 KV heads
    assert attention.o_proj.weight.shape == (64, 32) and attention.o_proj.bias.shape == (64,)
    assert model.layers[0].mlp.down_proj.weight.shape == (64, 48)
