"""Converting a big checkpoint needs memory for one tensor, not for the checkpoint.

Real DeepSpeed ZeRO-2 checkpoints of growing size (built by scripts/bench_convert.py's builder) are
converted in a fresh process whose peak RSS (getrusage) is measured: it must stay under 2x the
largest tensor + 400 MB and must not grow with the checkpoint. The same holds for the writers that
stream a file tensor by tensor (DCP, HF safetensors); their outputs are read by DCP's and the
safetensors library's own loaders.
"""

import importlib
import sys
from pathlib import Path

import pytest
import torch

from checkpoint.errors import CheckpointError
from checkpoint.execute import execute
from checkpoint.manifest import verify_manifest
from checkpoint.index import CheckpointIndex
from checkpoint.plan import ConversionPlan, TargetBuffer, TargetFile, TargetSpec, WriteMode

REPO = Path(__file__).resolve().parents[2]
HIDDEN = 512  # largest tensor: 512 x 512 fp32 = 1 MiB


def _bench():
    """scripts/bench_convert.py as a module (its spawned ranks import it by name: the path goes along)."""
    if str(REPO / "scripts") not in sys.path:
        sys.path.insert(0, str(REPO / "scripts"))
    return importlib.import_module("bench_convert")


@pytest.mark.slow
def test_peak_memory_is_flat_as_the_checkpoint_grows(tmp_path, workload_extensions_dir):
    bench = _bench()
    peaks: dict[tuple[float, str], int] = {}
    sizes = (0.04, 0.25)
    for size in sizes:
        src = bench.build_checkpoint(tmp_path / f"src{size}", size_gb=size, dp=2, hidden=HIDDEN)
        assert bench.dir_bytes(src) > 0.8 * size * 1e9
        for name, to, dp, stage in (("dp2->dp3", "deepspeed", 3, 2), ("z2->z3", "deepspeed", 2, 3),
                                    ("universal", "deepspeed_universal", None, None), ("dcp", "dcp", 1, None)):
            dst = tmp_path / f"out{size}_{name}"
            _, peak = bench.convert_in_subprocess(src, dst, to=to, dp=dp, stage=stage)
            assert verify_manifest(dst) == []
            peaks[(size, name)] = peak
    largest = HIDDEN * HIDDEN * 4
    bound = 2 * largest + (400 << 20)
    report = {k: f"{v / 2**20:.0f} MiB" for k, v in peaks.items()}
    assert all(v <= bound for v in peaks.values()), f"peak RSS over {bound / 2**20:.0f} MiB: {report}"
    for name in ("dp2->dp3", "z2->z3", "universal", "dcp"):
        growth = peaks[(sizes[1], name)] - peaks[(sizes[0], name)]
        # the checkpoint grows by ~210 MB (a rank's target file by ~100 MB); memory must not follow
        assert growth < 24 << 20, f"{name}: peak RSS grew by {growth / 2**20:.0f} MiB with the checkpoint: {report}"


class _Misplacing:
    """A writer of an IN_PLACE target that breaks its contract: the buffer is not at its key path."""

    def assemble(self, file, buffers, meta):
        return {"elsewhere": torch.zeros(3)}


def test_in_place_writer_that_misplaces_a_buffer_is_refused(tmp_path):
    target = TargetSpec(index=CheckpointIndex(format="x", root="", entries=(), files=("f.pt",)),
                        write_mode=WriteMode.IN_PLACE,
                        files=(TargetFile(path="f.pt", role="r", rank=0,
                                          buffers=(TargetBuffer(key=("w",), shape=(3,), dtype="float32"),)),))
    plan = ConversionPlan(source=CheckpointIndex(format="x", root=str(tmp_path), entries=(), files=()),
                          target=target, fixed_items=())
    with pytest.raises(CheckpointError, match=r"f\.pt.*no contiguous \(3,\) float32 tensor at \['w'\]"):
        execute(plan, _Misplacing(), tmp_path / "out")
    assert not (tmp_path / "out").exists()


class _Placing:
    def assemble(self, file, buffers, meta):
        return {"w": buffers[("w",)], "n": 7}


def test_in_place_writer_output_loads_with_zeros_where_nothing_was_copied(tmp_path):
    target = TargetSpec(index=CheckpointIndex(format="x", root="", entries=(), files=("f.pt",)),
                        write_mode=WriteMode.IN_PLACE,
                        files=(TargetFile(path="f.pt", role="r", rank=0,
                                          buffers=(TargetBuffer(key=("w",), shape=(2, 3), dtype="bfloat16"),)),))
    plan = ConversionPlan(source=CheckpointIndex(format="x", root=str(tmp_path), entries=(), files=()),
                          target=target, fixed_items=())
    execute(plan, _Placing(), tmp_path / "out")
    got = torch.load(tmp_path / "out" / "f.pt", weights_only=True)
    assert got["n"] == 7 and got["w"].dtype == torch.bfloat16
    assert torch.equal(got["w"], torch.zeros(2, 3, dtype=torch.bfloat16))
    assert verify_manifest(tmp_path / "out") == []


def _hf_source(root: Path, layers: int) -> Path:
    """A llama save_pretrained folder of `layers` layers, each one square fp32 matrix (HIDDEN x HIDDEN), beside a
    small embedding and its config.json."""
    import json

    from safetensors.torch import save_file

    root.mkdir(parents=True)
    g = torch.Generator().manual_seed(layers)
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(HIDDEN, HIDDEN, generator=g) for i in range(layers)}
    tensors |= {"model.embed_tokens.weight": torch.randn(8, HIDDEN, generator=g),
                "lm_head.weight": torch.randn(8, HIDDEN, generator=g)}
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": layers,
                                                  "hidden_size": HIDDEN, "vocab_size": 8}))
    return root


@pytest.mark.slow
def test_hf_writer_streams_tensor_by_tensor(tmp_path):
    """One 250 MB safetensors file is written holding one 1 MiB tensor at a time; safetensors reads it back."""
    from safetensors import safe_open

    bench = _bench()
    peaks = {}
    for layers in (40, 240):
        src = _hf_source(tmp_path / f"hf{layers}", layers)
        dst = tmp_path / f"out{layers}"
        _, peaks[layers] = bench.convert_in_subprocess(src, dst, to="hf", dp=None, stage=None)
        assert verify_manifest(dst) == []
        with safe_open(str(src / "model.safetensors"), "pt") as a, safe_open(str(dst / "model.safetensors"), "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys())
            assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
    growth = peaks[240] - peaks[40]  # the file grows by 210 MB
    assert growth < 24 << 20, f"peak RSS grew by {growth / 2**20:.0f} MiB: {peaks}"
    assert peaks[240] <= 2 * HIDDEN * HIDDEN * 4 + (400 << 20), peaks
