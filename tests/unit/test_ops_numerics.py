"""`migrate ops` numerics: operators in fp32/bf16/fp16 against float64 on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from convergence.ops.metrics import EPS, THRESHOLDS, tensor_error, ulp
from convergence.ops.numerics import CASES, OPERATORS, OpCase, check_dropout, check_operators, run_case


@pytest.fixture(scope="module")
def cpu_results():
    return check_operators("cpu", ("fp32", "bf16", "fp16"))


def test_every_transformer_operator_is_covered():
    for name in ("linear", "matmul", "bmm", "softmax", "log_softmax", "layer_norm", "rms_norm", "gelu", "silu",
                 "swiglu", "rotary", "scaled_dot_product_attention", "cross_entropy", "embedding", "dropout"):
        assert name in OPERATORS


def test_pytorch_cpu_kernels_pass_with_margin(cpu_results):
    assert len(cpu_results) == 3 * len(OPERATORS)
    failed = [(r.op, r.dtype, r.reason) for r in cpu_results if r.status != "pass"]
    assert not failed
    for r in cpu_results:
        if r.op == "dropout":
            continue
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[r.dtype]
        th, eps = THRESHOLDS[dtype], EPS[dtype]
        assert {t.name for t in r.tensors} >= {"out"} and len(r.tensors) >= 2  # forward and backward
        for t in r.tensors:  # the limits leave at least 2x headroom over the reference kernels
            assert t.max_abs_over_rms <= th.max_abs_eps * eps / 2, (r.op, r.dtype, t)
            assert t.max_rel <= th.max_rel_eps * eps / 2, (r.op, r.dtype, t)
            assert t.mean_ulp <= th.mean_ulp / 2 or r.dtype != "fp32", (r.op, r.dtype, t)


def test_a_kernel_that_approximates_is_caught():
    """A target whose GELU silently uses the tanh approximation fails in fp32 with the numbers."""
    approx = OpCase(name="gelu", grad=("x",), make=CASES[7].make,
                    fn=lambda x: F.gelu(x) if x.dtype == torch.float64 else F.gelu(x, approximate="tanh"))
    result = run_case(approx, "cpu", torch.float32, "fp32")
    assert result.status == "fail"
    assert "max relative error" in result.reason and "eps" in result.reason


def test_unsupported_dtype_is_reported_not_raised():
    inv = OpCase(name="inverse", grad=("a",), fn=lambda a: torch.linalg.inv(a),
                 make=lambda g: {"a": torch.eye(4, dtype=torch.float64)
                                 + 0.1 * torch.randn(4, 4, generator=g, dtype=torch.float64)})
    result = run_case(inv, "cpu", torch.float16, "fp16")
    assert result.status == "unsupported" and "Half" in result.reason


def test_dropout_statistics_and_a_wrong_rate():
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        assert check_dropout("cpu", dtype, name).status == "pass"
    # A kernel that drops 20 % when asked for 10 % fails on the kept fraction.
    wrong = check_dropout("cpu", torch.float32, "fp32", p=0.1,
                          dropout=lambda x, p, training: F.dropout(x, p=2 * p, training=training))
    assert wrong.status == "fail" and "kept" in wrong.reason and "expected 0.90000" in wrong.reason


def test_ulp_and_error_metrics():
    ref = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    assert ulp(ref, torch.bfloat16).tolist() == [2 ** -7, 2 ** -6, 2 ** -8]
    off = ref + ulp(ref, torch.bfloat16)
    err = tensor_error("x", off.to(torch.bfloat16), ref, torch.bfloat16)
    assert err.mean_ulp == pytest.approx(1.0) and err.passed
    bad = tensor_error("x", -ref.float(), ref, torch.float32)
    assert not bad.passed and any("cosine" in r for r in bad.reasons)


def test_unknown_operator_is_rejected():
    with pytest.raises(ValueError, match="unknown operator"):
        check_operators("cpu", ("fp32",), ops=("conv9d",))
