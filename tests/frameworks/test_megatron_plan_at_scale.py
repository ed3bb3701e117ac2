"""Planning a Megatron-Core conversion at 70B scale from metadata alone.

The source metadata (Llama-70B at TP8·PP8·DP16, DistributedOptimizer dp_reshardable) is synthesized
from the rules and the layout and read by the real reader; the plan to TP4·PP8·DP16 must finish in
under 5 s of CPU time, touch no file, and account for every byte: read = the source's model + optimizer
bytes, written = the target's (vocab padded for TP4), spread evenly over the 512 target ranks. The
synthesizer itself is checked against a checkpoint the real engine wrote.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from checkpoint.api import LayoutRequest, plan_conversion, read_index
from checkpoint.formats.megatron import FORMAT
from checkpoint.formats.megatron_synth import plan_figures, synthetic_index
from checkpoint.index import Kind
from checkpoint.layout import OptimizerSharding, ParallelLayout
from checkpoint.model_shape import ModelShape
from checkpoint.rules.megatron import RULES, canonical_tensors, stacked_shape

LLAMA_70B = ModelShape(architecture="llama", num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
                     num_attention_heads=64, num_query_groups=8, vocab_size=128256, make_vocab_size_divisible_by=128)
DIST_OPT = OptimizerSharding.DISTRIBUTED_OPTIMIZER


def test_70b_plan_from_metadata_only(monkeypatch):
    opened: list[str] = []
    real_open = open

    def spy(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", spy)
    cpu, wall = time.process_time(), time.perf_counter()
    index = synthetic_index(LLAMA_70B, ParallelLayout(tp=8, pp=8, dp=16, sharding=DIST_OPT))
    plan, _ = plan_conversion(index, to="megatron", target=LayoutRequest(dp=16, tp=4, pp=8))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    monkeypatch.undo()
    assert cpu < 5, f"planning took {cpu:.2f} s of CPU ({wall:.2f} s wall)"
    assert [f for f in opened if not f.endswith(".py")] == [] and not Path(index.root).exists()

    params = sum(e.numel for e in index.entries if e.key.kind is Kind.PARAM)
    assert 70.5e9 < params < 70.6e9
    assert (index.meta["tp"], index.meta["pp"], index.meta["sharding"]) == (8, 8, "dp_reshardable")
    model_plus_optim = params * (2 + 3 * 4)  # bf16 weights + fp32 master, exp_avg, exp_avg_sq
    padded = sum(math.prod(stacked_shape(r, LLAMA_70B, 4)) for r in RULES["llama"].all())
    fig = plan_figures(plan)
    print("\n" + fig.render())
    assert fig.bytes_read == model_plus_optim == index.nbytes
    assert fig.bytes_written == padded * (2 + 3 * 4) == sum(f.nbytes for f in plan.target.files)
    assert padded - params == 2 * (128512 - 128256) * 8192  # vocab padded to 512 = 128 * tp4, embedding + output
    assert (fig.source_files, fig.target_files, fig.target_ranks) == (1024, 512, 512)
    assert sorted(f.rank for f in plan.target.files) == list(range(512))
    assert fig.largest_share < 1.2 / 512, fig.render()
    assert fig.read_per_rank[0] > 0.8 * fig.bytes_read / 512


@pytest.mark.slow
@pytest.mark.parametrize("src", [(2, 1, 1, 1, False), (1, 1, 2, 2, True), (1, 1, 1, 1, True)],
                         ids=["tp2", "moe-dp2ep2", "moe-ep1"])
def test_synthesized_metadata_matches_engine_checkpoint(megatron_checkpoint, src):
    """Same DCP keys, global sizes and dtypes as Megatron-Core writes, and the same index after reading
    (MoE: experts in their own chained optimizer under EP, inside the dense buffer at EP 1)."""
    from tests.megatron_lm_fixtures import assert_synthesized_metadata_is_megatrons

    tp, pp, dp, ep, moe = src
    ck = megatron_checkpoint(tp, pp, dp, ep=ep, moe=moe, global_batch_size=12)  # shared with test_megatron_convert
    assert read_index(ck.path).format == FORMAT
    assert_synthesized_metadata_is_megatrons(ck.path, ParallelLayout(tp=tp, pp=pp, dp=dp, ep=ep, sharding=DIST_OPT))


@pytest.mark.parametrize("src,dst", [
    (ParallelLayout(tp=2, pp=2, vpp=2, dp=2, sharding=DIST_OPT), ParallelLayout(tp=1, pp=1, dp=1)),
    (ParallelLayout(tp=1, pp=2, vpp=2, dp=2, ep=2, sharding=DIST_OPT), ParallelLayout(tp=2, pp=4, dp=2, ep=2)),
    (ParallelLayout(tp=2, pp=2, dp=2, ep=1, sharding=DIST_OPT), ParallelLayout(tp=1, pp=1, dp=4, ep=4)),
], ids=["tp2pp2vpp2dp2-to-tp1", "moe-pp2vpp2ep2-to-tp2pp4ep2", "moe-tp2pp2ep1-to-dp4ep4"])
def test_virtual_pipeline_and_expert_layouts_plan_from_metadata(src, dst):
    """Layer ownership under virtual PP (layers of stage v on rank p: v*L/vpp + p*L/(pp*vpp) ...) and expert
    ownership under EP, read back from synthesized metadata: every canonical tensor complete, and the plan
    covers every target element from exactly the source's bytes."""
    moe = src.ep > 1 or dst.ep > 1
    arch = ModelShape(architecture="mixtral" if moe else "llama", num_layers=8, hidden_size=32, ffn_hidden_size=48,
                    num_attention_heads=4, num_query_groups=2, vocab_size=100, num_experts=4 if moe else 0)
    index = synthetic_index(arch, src, model_dtype="float32")
    got = tuple(index.meta[k] for k in ("tp", "pp", "vpp", "ep", "dp"))
    assert got == (src.tp, src.pp, src.vpp, src.ep, src.dp)
    names = {e.key.name for e in index.entries}
    assert names == {n for n, _ in canonical_tensors(arch)}
    plan, _ = plan_conversion(index, to="megatron", target=LayoutRequest(dp=dst.dp, tp=dst.tp, pp=dst.pp, ep=dst.ep))
    fig = plan_figures(plan)
    assert fig.bytes_read == index.nbytes
    assert fig.target_files == dst.world_size


@pytest.mark.slow
def test_deepseek_v3_671b_plans_from_2048_to_1024_ranks_with_uneven_stages():
    """scripts/plan_at_scale.py's plan: DeepSeek-V3 (61 layers: 4 on the first pipeline rank, 1 on the last, 4 on
    each of the 14 middle ones) PP16·EP64 -> PP16·EP32; every byte accounted for, the split kept in the target's
    Megatron-LM args, and the fullest rank's excess over the mean split into the layout's and the planner's share."""
    from checkpoint.formats.megatron_synth import pipeline_balance, render_balance
    from scripts.plan_at_scale import DEEPSEEK_V3

    source = ParallelLayout(tp=1, pp=16, dp=128, ep=64, sharding=DIST_OPT, first_pipeline_stage_layers=4,
                            last_pipeline_stage_layers=1)
    index = synthetic_index(DEEPSEEK_V3, source)
    assert (index.meta["first_pipeline_stage_layers"], index.meta["last_pipeline_stage_layers"]) == (4, 1)  # read from the args
    params = sum(e.numel for e in index.entries if e.key.kind is Kind.PARAM)
    assert 670.9e9 < params < 671.1e9, params
    plan, _ = plan_conversion(index, to="megatron", target=LayoutRequest(tp=1, pp=16, dp=64, ep=32))
    target = ParallelLayout.from_dict(plan.target.index.meta["target_layout"])
    assert (target.world_size, target.ep, target.first_pipeline_stage_layers,
            target.last_pipeline_stage_layers) == (1024, 32, 4, 1)
    (common,) = next(f for f in plan.target.described if f.path.endswith("/common.pt")).values  # planned common.pt
    args = common.value["args"]
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers, args.world_size,
            args.expert_model_parallel_size) == (4, 1, 1024, 32)
    fig = plan_figures(plan)
    biases = 58 * 256  # the router's expert bias: an fp32 buffer without optimizer state, on each MoE layer
    assert fig.bytes_read == fig.bytes_written == index.nbytes == (params - biases) * (2 + 3 * 4) + biases * 4
    assert (fig.source_files, fig.target_files) == (2048, 1024)
    balance = pipeline_balance(plan, DEEPSEEK_V3, target)
    assert [len(b.layers) for b, _ in balance] == [4] + [4] * 14 + [1]
    assert [b.ranks for b, _ in balance] == [64] * 16
    middle = [b.mean for b, _ in balance[1:-1]]
    assert max(middle) == min(middle) > 3 * balance[0][0].mean > 3 * balance[-1][0].mean  # dense first layers, head
    table = render_balance(balance)
    print("\n" + fig.render() + "\n" + table)
    assert fig.written_per_rank[2] == max(f for _, f in balance) < 1.01 * max(middle)  # the planner adds < 1%
