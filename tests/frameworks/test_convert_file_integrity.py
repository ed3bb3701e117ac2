"""What a converted checkpoint promises on disk: valid zip CRCs, a manifest whose CRC-32s catch any
changed byte (taken as the bytes were written: a converted file is not read back for them), DeepSpeed's
classes pickled under DeepSpeed's own names without importing deepspeed, and the byte-copy fast paths
equal to torch's own element copies.
"""

import io
import json
import math
import os
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint import safe_load
from checkpoint.copy_items import copy_item
from checkpoint.destination import MANIFEST
from checkpoint.execute import execute
from checkpoint.api import LayoutRequest, convert
from checkpoint.io import checksum
from checkpoint.io.checksum import Span, crc32_combine, crc_with_spans, file_crc32
from checkpoint.manifest import verify_manifest
from checkpoint.index import CheckpointIndex, ChunkRef, Kind, TensorKey
from checkpoint.plan import ConversionPlan, CopyItem, TargetBuffer, TargetFile, TargetSpec, WriteMode
from checkpoint.write import StreamPayload

REPO = Path(__file__).resolve().parents[2]


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_crc32_combine_equals_the_crc_of_the_concatenation(a, b):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_crc_from_known_pieces_equals_the_crc_of_the_bytes(tmp_path_factory, data):
    """Pieces whose CRC is known are combined, the bytes between them read; pieces written over each other
    (their last bytes unknown to the pieces' CRCs) make it read the whole range."""
    blob = data.draw(st.binary(min_size=1, max_size=4000))
    start = data.draw(st.integers(0, len(blob)))
    end = data.draw(st.integers(start, len(blob)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(blob)), max_size=12)))
    spans = [Span(a, b - a, zlib.crc32(blob[a:b])) for a, b in zip(cuts[::2], cuts[1::2])]
    if data.draw(st.booleans()) and spans:  # one piece claimed twice, as an overwrite would leave it
        spans.append(spans[0])
    path = tmp_path_factory.mktemp("crc") / "f"
    path.write_bytes(blob)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert crc_with_spans(fd, start, end, spans, 7) == zlib.crc32(blob[start:end], 7)
    finally:
        os.close(fd)


class _Placing:
    def assemble(self, file, buffers, meta):
        return {"w": buffers[("w",)], "v": buffers[("v",)], "n": 7}


def _written(tmp_path: Path) -> Path:
    """An in-place written file whose two tensors were copied from a torch.save'd source, file to file."""
    src = tmp_path / "src"
    src.mkdir()
    w, v = torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.arange(5, dtype=torch.bfloat16)
    torch.save({"w": w, "v": v}, src / "a.pt")
    key_w, key_v = TensorKey(name="w", kind=Kind.PARAM), TensorKey(name="v", kind=Kind.PARAM)
    items = (CopyItem(tensor=key_w, src=ChunkRef(file="a.pt", key=("w",), offsets=(0, 0), lengths=(3, 4)),
                      dst=ChunkRef(file="f.pt", key=("w",), offsets=(0, 0), lengths=(3, 4)), flat=None,
                      narrows=((0, 1, 1, 2),), numel=8),
             CopyItem(tensor=key_v, src=ChunkRef(file="a.pt", key=("v",), offsets=(0,), lengths=(5,)),
                      dst=ChunkRef(file="f.pt", key=("v",), offsets=(0,), lengths=(5,)), flat=(1, 0, 4), narrows=None,
                      numel=4))
    target = TargetSpec(index=CheckpointIndex(format="x", root="", entries=(), files=("f.pt",)),
                        write_mode=WriteMode.IN_PLACE,
                        files=(TargetFile(path="f.pt", role="r", rank=0,
                                          buffers=(TargetBuffer(key=("w",), shape=(3, 4), dtype="float32"),
                                                   TargetBuffer(key=("v",), shape=(5,), dtype="bfloat16"))),))
    plan = ConversionPlan(source=CheckpointIndex(format="x", root=str(src), entries=(), files=("a.pt",)),
                          target=target, fixed_items=items)
    execute(plan, _Placing(), tmp_path / "out")
    return tmp_path / "out"


def test_in_place_file_is_a_valid_zip_and_its_manifest_crc_is_the_files(tmp_path):
    out = _written(tmp_path)
    got = torch.load(out / "f.pt", weights_only=True)
    assert torch.equal(got["w"], torch.tensor([[0.0] * 4, [4, 5, 6, 7], [8, 9, 10, 11]]))
    assert torch.equal(got["v"], torch.tensor([1, 2, 3, 4, 0], dtype=torch.bfloat16)) and got["n"] == 7
    with zipfile.ZipFile(out / "f.pt") as z:
        assert z.testzip() is None  # every record's CRC-32 matches its bytes
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["version"] == 2
    record = manifest["files"]["f.pt"]
    assert record["crc32"] == f"{zlib.crc32((out / 'f.pt').read_bytes()):08x}" == file_crc32(out / "f.pt")
    assert verify_manifest(out) == []


class _Patching:
    """A streaming writer that writes its header last, seeking back to it (as safetensors-like writers may)."""

    def assemble(self, file, buffers, meta):
        def write(f):
            f.write(b"\0" * 8)
            f.write(bytes(buffers[("v",)].numpy()))
            f.seek(0)
            f.write(b"HEADER!!")
            f.seek(0, 2)
        return StreamPayload(write=write)


@pytest.mark.parametrize("writer", [_Placing(), _Patching()], ids=["in_place", "streaming_with_seek"])
def test_manifest_crc_taken_while_writing_is_the_files(tmp_path, writer):
    """The CRC-32 the manifest records is taken from the writes, not from reading the file back; a payload
    that seeks back over what it wrote still gets the file's CRC."""
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "v": torch.arange(5.0)}, src / "a.pt")
    keys = {"w": TensorKey(name="w", kind=Kind.PARAM), "v": TensorKey(name="v", kind=Kind.PARAM)}
    shapes = {"w": (3, 4), "v": (5,)}
    items = tuple(CopyItem(tensor=keys[n], src=ChunkRef(file="a.pt", key=(n,), offsets=(0,) * len(shapes[n]),
                                                         lengths=shapes[n]),
                           dst=ChunkRef(file="f.pt", key=(n,), offsets=(0,) * len(shapes[n]), lengths=shapes[n]),
                           flat=(0, 0, math.prod(shapes[n])), narrows=None, numel=math.prod(shapes[n]))
                  for n in ("w", "v"))
    mode = WriteMode.IN_PLACE if isinstance(writer, _Placing) else WriteMode.STREAMING
    target = TargetSpec(index=CheckpointIndex(format="x", root="", entries=(), files=("f.pt",)), write_mode=mode,
                        files=(TargetFile(path="f.pt", role="r", rank=0,
                                          buffers=tuple(TargetBuffer(key=(n,), shape=shapes[n], dtype="float32")
                                                        for n in ("w", "v"))),))
    plan = ConversionPlan(source=CheckpointIndex(format="x", root=str(src), entries=(), files=("a.pt",)),
                          target=target, fixed_items=items)
    execute(plan, writer, tmp_path / "out")
    data = (tmp_path / "out" / "f.pt").read_bytes()
    if isinstance(writer, _Patching):
        assert data == b"HEADER!!" + bytes(torch.arange(5.0).numpy())
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["files"]["f.pt"]["crc32"] == f"{zlib.crc32(data):08x}"


def test_manifest_catches_a_flipped_bit_and_a_truncation(tmp_path):
    out = _written(tmp_path)
    data = bytearray((out / "f.pt").read_bytes())
    data[len(data) // 2] ^= 0x10
    (out / "f.pt").write_bytes(bytes(data))
    problems = verify_manifest(out)
    assert len(problems) == 1 and "crc32" in problems[0] and "f.pt" in problems[0]
    (out / "f.pt").write_bytes(bytes(data[:-1]))
    assert any("bytes" in p for p in verify_manifest(out))


def test_version_1_manifests_with_sha256_still_verify(tmp_path):
    import hashlib

    (tmp_path / "a.bin").write_bytes(b"abc")
    (tmp_path / MANIFEST).write_text(json.dumps({"version": 1, "files": {"a.bin": {
        "bytes": 3, "sha256": hashlib.sha256(b"abc").hexdigest()}}}))
    assert verify_manifest(tmp_path) == []
    (tmp_path / "a.bin").write_bytes(b"abd")
    assert "sha256" in verify_manifest(tmp_path)[0]


def _data_pkl(obj, **kw) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, **kw)
    with zipfile.ZipFile(buf) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


@pytest.mark.slow
def test_stand_ins_pickle_exactly_as_deepspeeds_own_classes():
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    ours = {"zero_stage": safe_load.ZeroStageEnum(2), "loss_scaler": safe_load.LossScaler(scale=1.0),
            "map": {"a": safe_load.fragment_address(numel=3, start=0),
                    "b": safe_load.fragment_address(numel=5, start=3)},
            "again": safe_load.ZeroStageEnum(2), "t": torch.ones(2)}
    real = {"zero_stage": ZeroStageEnum(2), "loss_scaler": LossScaler(scale=1.0),
            "map": {"a": fragment_address(numel=3, start=0), "b": fragment_address(numel=5, start=3)},
            "again": ZeroStageEnum(2), "t": torch.ones(2)}
    assert _data_pkl(ours, pickle_module=safe_load.PICKLE_MODULE) == _data_pkl(real)
    # pickled without our pickler, a stand-in becomes the real class (DeepSpeed loads it as its own)
    back = torch.load(io.BytesIO(_save(ours)), weights_only=False)
    assert type(back["zero_stage"]) is ZeroStageEnum and back["zero_stage"] == ZeroStageEnum.gradients
    assert type(back["map"]["b"]) is fragment_address and back["map"]["b"] == fragment_address(numel=5, start=3)
    assert vars(back["loss_scaler"]) == vars(LossScaler(scale=1.0))
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    from checkpoint.formats.deepspeed import GRADIENT_CLIPPING_DEFAULT as ours_default

    assert ours_default == GRADIENT_CLIPPING_DEFAULT  # the default our writer stores without importing deepspeed


@pytest.mark.slow
def test_megatron_stand_ins_pickle_exactly_as_megatron_cores_own_classes(tmp_path):
    """...also where Megatron-Core registered its own classes as torch's safe globals (at import): a load gets
    the stand-ins, never one or the other by the order of torch's set."""
    import copy

    import megatron.core.safe_globals  # noqa: F401  # registers ModelType, AttnBackend, OptimizerConfig, ...
    from megatron.core.enums import ModelType
    from megatron.core.optimizer.optimizer_config import OptimizerConfig
    from megatron.core.rerun_state_machine import RerunMode
    from megatron.core.transformer.enums import AttnBackend

    def stand_in(real):
        return safe_load.STAND_INS[f"{type(real).__module__}.{type(real).__qualname__}"]

    config = OptimizerConfig(lr=3e-4, weight_decay=0.1)
    ours_config = stand_in(config).__new__(stand_in(config))
    ours_config.__dict__.update(vars(config))
    real = {"model_type": ModelType.encoder_or_decoder, "attention_backend": AttnBackend.auto,
            "rerun_mode": RerunMode.DISABLED, "again": AttnBackend.auto, "config": config}
    ours = {k: v if k == "config" else stand_in(v)(v.value) for k, v in real.items()}
    assert ours["again"] is ours["attention_backend"]  # one object per member, as the Enum's
    ours["config"] = ours_config
    assert _data_pkl(ours, pickle_module=safe_load.PICKLE_MODULE) == _data_pkl(real)
    torch.save(real, tmp_path / "args.pt")
    read = safe_load.load(tmp_path / "args.pt")  # through the allow-list: the stand-ins, equal to ours
    assert read == ours and copy.deepcopy(read) == ours and type(copy.copy(read["config"])) is type(ours_config)
    # pickled without our pickler, a stand-in becomes the real class (Megatron-Core loads it as its own)
    back = torch.load(io.BytesIO(_save(read)), weights_only=False)
    assert {k: v for k, v in back.items() if k != "config"} == {k: v for k, v in real.items() if k != "config"}
    assert type(back["config"]) is OptimizerConfig and vars(back["config"]) == vars(config)
    with pytest.raises(ValueError, match=r"\[1\] is not a valid megatron.core.transformer.enums.AttnBackend"):
        stand_in(AttnBackend.auto)([1])


def _save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.slow
def test_converting_a_deepspeed_checkpoint_does_not_import_deepspeed(deepspeed_checkpoint, tmp_path):
    src = deepspeed_checkpoint(2, 1).path
    code = ("import sys, json; from checkpoint.api import LayoutRequest, convert; "
            f"convert({str(src)!r}, {str(tmp_path / 'out')!r}, to='deepspeed', target=LayoutRequest(dp=4, zero_stage=3)); "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
    assert verify_manifest(tmp_path / "out") == []


@pytest.mark.slow
def test_a_dp_change_takes_its_checksums_without_reading_what_it_wrote(deepspeed_checkpoint, tmp_path,
                                                                       monkeypatch):
    """The CRC-32s of the manifest and of the zip records come from the writes: the only bytes read back
    are the few around the tensors (zip headers, pickles); every one of them still matches the file."""
    src = deepspeed_checkpoint(2, 1).path
    read_back: list[int] = []
    crc_range = checksum.crc_range

    def counting(fd, start, end, value=0):
        read_back.append(end - start)
        return crc_range(fd, start, end, value)

    monkeypatch.setattr(checksum, "crc_range", counting)
    convert(src, tmp_path / "out", to="deepspeed", target=LayoutRequest(dp=4, zero_stage=2))
    monkeypatch.undo()
    out = tmp_path / "out"
    tensor_bytes = around = 0
    for path in out.rglob("*.pt"):
        with zipfile.ZipFile(path) as z:
            assert z.testzip() is None, path
            data = sum(i.compress_size for i in z.infolist() if "/data/" in i.filename)
        tensor_bytes, around = tensor_bytes + data, around + path.stat().st_size - data
    assert tensor_bytes > around > 0
    assert sum(read_back) <= around, (sum(read_back), around, tensor_bytes)
    assert verify_manifest(out) == []


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_copy_item_fast_paths_equal_torchs_element_copy(data):
    """Box items (narrowed chunks) copy exactly what torch's narrow + copy_ copies, fast path or not."""
    nd = data.draw(st.integers(1, 3))
    slen = tuple(data.draw(st.integers(1, 4)) for _ in range(nd))
    dlen = tuple(data.draw(st.integers(1, 4)) for _ in range(nd))
    narrows = []
    for d in range(nd):
        if slen[d] != dlen[d] or data.draw(st.booleans()):
            n = data.draw(st.integers(1, min(slen[d], dlen[d])))
            narrows.append((d, data.draw(st.integers(0, slen[d] - n)), data.draw(st.integers(0, dlen[d] - n)), n))
    so, do = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    key = TensorKey(name="w", kind=Kind.PARAM)
    item = CopyItem(tensor=key, src=ChunkRef(file="a", key=("a",), offsets=(0,) * nd, lengths=slen, storage_offset=so),
                    dst=ChunkRef(file="b", key=("b",), offsets=(0,) * nd, lengths=dlen, storage_offset=do), flat=None,
                    narrows=tuple(narrows), numel=0)
    src = torch.arange(so + torch.Size(slen).numel() + 2, dtype=torch.float32) + 1
    dst = torch.zeros(do + torch.Size(dlen).numel() + 2)
    copy_item(item, src, dst, src_where="src")
    want = torch.zeros_like(dst)
    sview, dview = src[so:so + torch.Size(slen).numel()].view(slen), want[do:do + torch.Size(dlen).numel()].view(dlen)
    for dim, a, b, n in narrows:
        sview, dview = sview.narrow(dim, a, n), dview.narrow(dim, b, n)
    dview.copy_(sview)
    assert torch.equal(dst, want)
