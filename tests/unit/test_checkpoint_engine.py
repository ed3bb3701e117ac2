"""The conversion engine on small synthetic checkpoints: resharding, atomic writes, refusals."""

import errno
import hashlib
import json
from pathlib import Path

import pytest
import torch

from checkpoint import safe_load
from checkpoint.destination import MANIFEST
from checkpoint.errors import CheckpointFormatError, DestinationError, PlanError, UntrustedCheckpointError
from checkpoint.execute import execute
from checkpoint.manifest import verify_manifest
from checkpoint.index import CheckpointIndex, ChunkRef, Kind, TensorEntry, TensorKey
from checkpoint.plan import TargetBuffer, TargetFile, TargetSpec, make_plan, summarize

SHAPE = (5, 3)
KEY = TensorKey(name="w", kind=Kind.PARAM)


class Opaque:
    """A class no framework stores: loading it needs trust."""

    def __init__(self, value):
        self.value = value


class DictWriter:
    """Test writer: a target file is {buffer key: tensor}."""

    def assemble(self, file, buffers, meta):
        return {k[0]: v for k, v in buffers.items()}


def _row_sharded_source(root: Path, rows=(2, 3)) -> tuple[CheckpointIndex, torch.Tensor]:
    """A tensor split by rows into files rank{r}.pt (box chunks)."""
    full = torch.arange(15, dtype=torch.float32).reshape(SHAPE)
    chunks, start = [], 0
    for r, n in enumerate(rows):
        torch.save({"w": full[start:start + n].clone()}, root / f"rank{r}.pt")
        chunks.append(ChunkRef(file=f"rank{r}.pt", key=("w",), offsets=(start, 0), lengths=(n, 3)))
        start += n
    entry = TensorEntry(key=KEY, shape=SHAPE, dtype="float32", chunks=tuple(chunks))
    entry.check_complete()
    return CheckpointIndex(format="test", root=str(root), entries=(entry,),
                           files=tuple(c.file for c in chunks)), full


def _flat_target(parts: int) -> TargetSpec:
    """The tensor flattened, cut into `parts` flat pieces of ceil(15/parts), padded (ZeRO-3 style)."""
    c = -(-15 // parts)
    files, chunks = [], []
    for r in range(parts):
        lo, hi = r * c, min((r + 1) * c, 15)
        files.append(TargetFile(path=f"out{r}.pt", role="flat", rank=r,
                                buffers=(TargetBuffer(key=("w",), shape=(c,), dtype="float32"),)))
        chunks.append(ChunkRef(file=f"out{r}.pt", key=("w",), offsets=(0, 0), lengths=SHAPE, flat_range=(lo, hi)))
    entry = TensorEntry(key=KEY, shape=SHAPE, dtype="float32", chunks=tuple(chunks))
    return TargetSpec(index=CheckpointIndex(format="test", root="", entries=(entry,),
                                            files=tuple(f.path for f in files)), files=tuple(files))


def _digest(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


def test_row_shards_convert_to_padded_flat_shards_exactly(tmp_path):
    (tmp_path / "src").mkdir()
    source, full = _row_sharded_source(tmp_path / "src")
    plan = make_plan(source, _flat_target(4))
    assert "rank 3" in summarize(plan)
    result = execute(plan, DictWriter(), tmp_path / "dst")
    pieces = [torch.load(tmp_path / "dst" / f"out{r}.pt", weights_only=True)["w"] for r in range(4)]
    assert torch.equal(torch.cat(pieces)[:15].view(SHAPE), full)
    assert torch.equal(torch.cat(pieces)[15:], torch.zeros(1))
    assert verify_manifest(tmp_path / "dst") == []
    manifest = json.loads((tmp_path / "dst" / MANIFEST).read_text())
    assert sorted(manifest["files"]) == [f"out{r}.pt" for r in range(4)]
    assert result.nbytes == sum(f.stat().st_size for f in (tmp_path / "dst").glob("out*.pt"))


def test_flat_shards_convert_back_to_row_shards(tmp_path):
    (tmp_path / "src").mkdir()
    source, full = _row_sharded_source(tmp_path / "src", rows=(1, 4))
    execute(make_plan(source, _flat_target(3)), DictWriter(), tmp_path / "flat")
    flat_index = _flat_target(3).index
    flat_index = CheckpointIndex(format="test", root=str(tmp_path / "flat"), entries=flat_index.entries,
                                 files=flat_index.files)
    rows, _ = _row_sharded_source(tmp_path / "src", rows=(3, 2))  # target layout: rows 3 + 2
    target = TargetSpec(index=rows, files=tuple(
        TargetFile(path=c.file, role="rows", rank=r, buffers=(TargetBuffer(key=("w",), shape=c.lengths, dtype="float32"),))
        for r, c in enumerate(rows.entries[0].chunks)))
    execute(make_plan(flat_index, target), DictWriter(), tmp_path / "rows")
    back = torch.cat([torch.load(tmp_path / "rows" / f"rank{r}.pt", weights_only=True)["w"] for r in range(2)])
    assert torch.equal(back, full)


def test_non_empty_destination_is_refused_and_left_alone(tmp_path):
    (tmp_path / "src").mkdir()
    source, _ = _row_sharded_source(tmp_path / "src")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(DestinationError, match="not empty"):
        execute(make_plan(source, _flat_target(2)), DictWriter(), dst)
    assert (dst / "keep.txt").read_text() == "mine"


def test_disk_full_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    (tmp_path / "src").mkdir()
    source, _ = _row_sharded_source(tmp_path / "src")
    before = _digest(tmp_path / "src")
    real_save, calls = torch.save, []

    def save_until_full(obj, f, *a, **k):
        calls.append(f)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save_until_full)
    with pytest.raises(DestinationError, match=r"out2\.pt.*No space left"):
        execute(make_plan(source, _flat_target(4)), DictWriter(), tmp_path / "dst")
    assert not (tmp_path / "dst").exists()
    assert _digest(tmp_path / "src") == before


def test_plan_reports_shape_mismatch_and_gaps(tmp_path):
    (tmp_path / "src").mkdir()
    source, _ = _row_sharded_source(tmp_path / "src")
    bad = TensorEntry(key=KEY, shape=(3, 5), dtype="float32",
                      chunks=(ChunkRef(file="out0.pt", key=("w",), offsets=(0, 0), lengths=(3, 5)),))
    spec = TargetSpec(index=CheckpointIndex(format="test", root="", entries=(bad,), files=("out0.pt",)),
                      files=(TargetFile(path="out0.pt", role="x", rank=0),))
    with pytest.raises(PlanError, match=r"w\[param\]: source shape \(5, 3\) != target shape \(3, 5\)"):
        make_plan(source, spec)
    gappy = CheckpointIndex(format="test", root=source.root, files=source.files, entries=(
        TensorEntry(key=KEY, shape=SHAPE, dtype="float32", chunks=source.entries[0].chunks[:1]),))
    with pytest.raises(PlanError, match=r"out0\.pt .* needs 8 elements, the source covers 6"):
        make_plan(gappy, _flat_target(2))
    with pytest.raises(CheckpointFormatError, match="chunks hold 6 elements but shape"):
        gappy.entries[0].check_complete()


def test_safe_load_refuses_unlisted_classes_unless_trusted(tmp_path):
    path = tmp_path / "odd.pt"
    torch.save({"w": torch.ones(2), "extra": Opaque(3)}, path)
    with pytest.raises(UntrustedCheckpointError, match=r"odd\.pt: refusing to unpickle .*Opaque"):
        safe_load.load(path)
    assert safe_load.load(path, trust_checkpoint=True)["extra"].value == 3


def test_truncated_and_missing_files_are_named(tmp_path):
    path = tmp_path / "shard.pt"
    torch.save({"w": torch.ones(1000)}, path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointFormatError, match=r"shard\.pt.*truncated"):
        safe_load.load(path)
    with pytest.raises(CheckpointFormatError, match=r"gone\.pt: file is missing"):
        safe_load.load(tmp_path / "gone.pt")
