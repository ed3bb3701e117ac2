"""`migrate ops` coverage scan and per-layer drift of one training step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from convergence.ops.coverage import dispatch_key_for, op_status, record_operators, scan
from convergence.ops.drift import RunConfig, compare_step


class Block(nn.Module):
    """A pre-norm transformer block: RMSNorm, causal attention, SwiGLU MLP."""

    def __init__(self, h: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(h), nn.RMSNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h, bias=False), nn.Linear(h, h, bias=False)
        self.gate, self.up = nn.Linear(h, 2 * h, bias=False), nn.Linear(h, 2 * h, bias=False)
        self.down = nn.Linear(2 * h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 32), Block(), Block(), nn.LayerNorm(32), nn.Linear(32, 50))


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    ids, = batch
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


BATCH = (torch.randint(0, 50, (2, 17), generator=torch.Generator().manual_seed(1)),)


def test_coverage_scan_lists_every_operator_and_finds_none_missing_on_cpu():
    model = make_model()
    recorded = record_operators(lambda: loss_fn(model, BATCH).backward())
    assert recorded.counts["aten::mm"] > 0 and any("softmax" in op or "attention" in op for op in recorded.counts)
    report = scan(recorded, dispatch_key_for("cpu"))
    assert report.dispatch_key == "CPU"
    assert report.passed and not report.missing, report.to_dict()
    assert {o.status for o in report.ops} <= {"native", "composite"}


def test_coverage_scan_reports_an_operator_the_target_lacks():
    lib = torch.library.Library("migrate_cov_test", "DEF")
    lib.define("scale2(Tensor x) -> Tensor")
    lib.impl("scale2", lambda x: x * 2, "CPU")
    recorded = record_operators(lambda: torch.ops.migrate_cov_test.scale2(torch.ones(3)) + torch.ones(3))
    on_meta = scan(recorded, dispatch_key_for("meta"))
    # Meta registers a boxed backend fallback, so the op counts as falling back (it has no kernel of its own).
    assert "migrate_cov_test::scale2" in on_meta.missing + on_meta.fallback
    assert not on_meta.passed
    row = next(o for o in on_meta.ops if o.op == "migrate_cov_test::scale2")
    assert row.status in ("missing", "fallback") and "no Meta kernel" in row.detail
    assert op_status("aten::add.Tensor", "Meta")[0] == "native"
    assert scan(recorded, "CPU").passed


def test_identical_runs_do_not_drift():
    report = compare_step(make_model, BATCH, loss_fn, RunConfig(), RunConfig())
    assert report.first_drift is None
    assert max(x.rel_error for x in report.layers) == 0.0


def test_first_drifting_layer_is_found():
    """Run b's second block computes its MLP output wrong: drift starts exactly there."""
    def corrupt(model: nn.Module) -> None:
        model[2].down.register_forward_hook(lambda mod, args, out: out * 1.01)

    report = compare_step(make_model, BATCH, loss_fn, RunConfig(), RunConfig(), prepare_b=corrupt)
    assert report.first_drift == "2.down"
    assert all(not x.drifts for x in report.layers if x.kind == "activation" and x.layer.startswith(("0", "1")))
    assert report.loss_a != report.loss_b


def test_bf16_against_fp32_stays_within_the_bf16_limit():
    report = compare_step(make_model, BATCH, loss_fn, RunConfig(dtype=torch.bfloat16), RunConfig(dtype=torch.float32))
    acts = [x for x in report.layers if x.kind == "activation"]
    assert acts and report.limit == 1e-1
    assert report.first("activation") is None, [(x.layer, x.rel_error) for x in acts]
    assert 0 < max(x.rel_error for x in acts) < report.limit
