"""A corpus of malformed inputs, each answered as a user needs: exit 2, one line naming the file or field,
nothing written, no traceback.

Checkpoints come from the real frameworks (DeepSpeed ZeRO-2, FSDP2 + DCP, Megatron-Core torch_dist, Megatron-LM
legacy files) and are broken one way each; jobs, tolerances, model configs, metric files and command-line
numbers are broken the ways a hostile or unlucky user breaks them.
"""

from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

import pytest
import torch
from click.testing import CliRunner

from checkpoint import safe_load
from migrate.cli import main as cli

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Case:
    name: str
    source: str | None  # which real checkpoint to copy (None: none needed)
    make: Callable[[Path, Path], list[str]]  # (copy of the source or an empty dir, tmp dir) -> CLI arguments
    needles: tuple[str, ...]  # what the one error line must name


def _truncate(path: Path, keep: int = 1000) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _resave(path: Path, edit: Callable[[object], object]) -> None:
    torch.save(edit(torch.load(path, weights_only=False)), path)


def _md_edit(root: Path, edit: Callable[[object], None]) -> None:
    md = safe_load.read_dcp_metadata(root)
    edit(md)
    (root / ".metadata").write_bytes(pickle.dumps(md))


def _first_storage(md, **changes) -> None:
    import dataclasses

    idx = next(iter(md.storage_data))
    md.storage_data[idx] = dataclasses.replace(md.storage_data[idx], **changes)


def _inspect(path: Path) -> list[str]:
    return ["inspect", str(path)]


def _convert(src: Path, tmp: Path, *extra: str) -> list[str]:
    return ["convert", str(src), str(tmp / "out"), *(extra or ("--to", "dcp"))]


def _tag(root: Path) -> Path:
    return next(p for p in root.iterdir() if p.is_dir())


def _optim(root: Path, rank: int) -> Path:
    return next(_tag(root).glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))


def _model(root: Path) -> Path:
    return _tag(root) / "mp_rank_00_model_states.pt"


def _iter(root: Path) -> Path:
    return sorted(p for p in root.iterdir() if p.name.startswith("iter_"))[0]


def ds(make: Callable[[Path], None], *needles: str, convert: bool = False, name: str = "") -> Case:
    def run(src: Path, tmp: Path) -> list[str]:
        make(src)
        return _convert(src, tmp, "--to", "deepspeed", "--dp", "3") if convert else _inspect(src)
    return Case(name, "deepspeed", run, needles)


def dcp(make: Callable[[Path], None], *needles: str, convert: bool = False, name: str = "") -> Case:
    def run(src: Path, tmp: Path) -> list[str]:
        make(src)
        return _convert(src, tmp, "--to", "dcp", "--dp", "1") if convert else _inspect(src)
    return Case(name, "dcp", run, needles)


def mcore(make: Callable[[Path], None], *needles: str, name: str = "") -> Case:
    def run(save: Path, tmp: Path) -> list[str]:
        make(save)
        return _inspect(save)
    return Case(name, "megatron", run, needles)


def legacy(make: Callable[[Path], None], *needles: str, name: str = "") -> Case:
    def run(save: Path, tmp: Path) -> list[str]:
        make(_iter(save))
        return _inspect(_iter(save))
    return Case(name, "megatron_legacy", run, needles)


def write(rel: str, data: bytes | str) -> Callable[[Path], None]:
    def make(root: Path) -> None:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return make


def _older_step(root: Path) -> None:
    """Rank 1's optimizer shard taken from another save: its Adam step differs."""
    def edit(obj):
        state = obj["optimizer_state_dict"]["base_optimizer_state"]["state"]
        for s in state.values():
            s["step"] = s["step"] - 2 if isinstance(s["step"], torch.Tensor) else s["step"] - 2
        return obj
    _resave(_optim(root, 1), edit)


def _legacy_other_iteration(root: Path) -> None:
    path = sorted(root.glob("mp_rank_*/model_optim_rng.pt"))[-1]
    _resave(path, lambda s: {**s, "iteration": int(s["iteration"]) + 2})


def _job(text: str | bytes) -> Callable[[Path, Path], list[str]]:
    def run(_src: Path, tmp: Path) -> list[str]:
        p = tmp / "job.yaml"
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        return ["validate", str(p)]
    return run


BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(10))


def _tolerances(text: str) -> Callable[[Path, Path], list[str]]:
    def run(_src: Path, tmp: Path) -> list[str]:
        run_file = tmp / "run.jsonl"
        run_file.write_text("".join(json.dumps({"step": s, "loss": 2.0 - s / 100}) + "\n" for s in range(1, 20)))
        tol = tmp / "tol.yaml"
        tol.write_text(text)
        return ["gate", "--baseline", str(run_file), "--candidate", str(run_file), "--tolerances", str(tol)]
    return run


def _gate_candidate(name: str, data: bytes | None) -> Callable[[Path, Path], list[str]]:
    def run(_src: Path, tmp: Path) -> list[str]:
        base = tmp / "base.jsonl"
        base.write_text("".join(json.dumps({"step": s, "loss": 2.0 - s / 100}) + "\n" for s in range(1, 20)))
        cand = tmp / name
        if data is not None:
            cand.write_bytes(data)
        return ["gate", "--baseline", str(base), "--candidate", str(cand)]
    return run


def _nan_baseline(tmp: Path) -> list[str]:
    base = tmp / "base.jsonl"
    base.write_text("".join(json.dumps({"step": s, "loss": float("nan") if s == 7 else 2.0 - s / 100}) + "\n"
                            for s in range(1, 20)))
    cand = tmp / "cand.jsonl"
    cand.write_text("".join(json.dumps({"step": s, "loss": 2.0 - s / 100}) + "\n" for s in range(1, 20)))
    return ["gate", "--baseline", str(base), "--candidate", str(cand)]


def _model_config(text: str) -> Callable[[Path, Path], list[str]]:
    def run(src: Path, tmp: Path) -> list[str]:
        cfg = tmp / "model.yaml"
        cfg.write_text(text)
        return ["convert", str(src), str(tmp / "out"), "--to", "megatron", "--model-config", str(cfg)]
    return run


def _cli(*args: str) -> Callable[[Path, Path], list[str]]:
    def run(src: Path, tmp: Path) -> list[str]:
        return ["convert", str(src), str(tmp / "out"), *args]
    return run


CASES = [
    # DeepSpeed ZeRO-2 (2 ranks), as DeepSpeed's engine saved it
    ds(write("latest", "../../etc"), "latest", "'../../etc'", name="ds latest escapes"),
    ds(write("latest", ""), "latest", "names tag ''", name="ds latest empty"),
    ds(write("latest", "global_step404"), "latest", "global_step404", name="ds latest names a missing tag"),
    ds(write("latest", "a/b"), "latest", "'a/b'", name="ds latest with a slash"),
    ds(write("latest", b"\xff\xfe\x00garbage"), "latest", name="ds latest not text"),
    ds(lambda r: _truncate(_optim(r, 1)), "zero_pp_rank_1_mp_rank_00_optim_states.pt", "truncated",
       name="ds optimizer shard truncated"),
    ds(lambda r: _optim(r, 1).unlink(), "ranks [1] are missing", name="ds optimizer shard missing"),
    ds(lambda r: _optim(r, 0).write_bytes(b""), "zero_pp_rank_0_mp_rank_00_optim_states.pt",
       name="ds optimizer shard empty"),
    ds(lambda r: _truncate(_model(r), 500), "mp_rank_00_model_states.pt", name="ds model states truncated"),
    ds(lambda r: _model(r).write_bytes(bytes(range(256)) * 40), "mp_rank_00_model_states.pt",
       name="ds model states random bytes"),
    ds(lambda r: torch.save([1, 2, 3], _model(r)), "mp_rank_00_model_states.pt", "list",
       name="ds model states of the wrong type"),
    ds(lambda r: _resave(_model(r), lambda s: {k: v for k, v in s.items() if k != "param_shapes"}),
       "mp_rank_00_model_states.pt", "param_shapes", name="ds model states without param_shapes"),
    ds(lambda r: _resave(_model(r), lambda s: {**s, "dp_world_size": "two"}), "mp_rank_00_model_states.pt",
       "dp_world_size", name="ds dp_world_size not a number"),
    ds(_older_step, "disagree on Adam's step", "zero_pp_rank_1", name="ds shard from another save"),
    ds(lambda r: shutil.copy(_optim(r, 0), _optim(r, 0).with_name(_optim(r, 0).name.replace("pp_rank_0_", "pp_rank_5_"))),
       "unexpected", name="ds extra shard"),
    ds(lambda r: _resave(_model(r), lambda s: {**s, "dp_world_size": 3}), "dp_world_size=3",
       name="ds dp size contradicts the shards"),
    ds(write("global_step2/layer_01-model_00-model_states.pt", b""), "layer_01-model_00-model_states.pt",
       name="ds pipeline-engine file"),
    ds(lambda r: torch.save(torch.load(_model(r), weights_only=False), _model(r), _use_new_zipfile_serialization=False),
       "legacy non-zip format", name="ds legacy torch format"),
    ds(lambda r: _truncate(_optim(r, 1), 20000), "zero_pp_rank_1", convert=True, name="ds truncated shard on convert"),
    # PyTorch DCP (FSDP2, 2 ranks)
    dcp(lambda r: _truncate(r / ".metadata", 100), ".metadata", name="dcp metadata truncated"),
    dcp(write(".metadata", b"\x00garbage\xff" * 10), ".metadata", name="dcp metadata garbage"),
    dcp(write(".metadata", b""), ".metadata", name="dcp metadata empty"),
    dcp(write(".metadata", pickle.dumps({"state_dict_metadata": {}})), ".metadata", "not DCP Metadata",
        name="dcp metadata of the wrong type"),
    dcp(lambda r: next(r.glob("*.distcp")).unlink(), "missing", name="dcp data file missing"),
    dcp(lambda r: _md_edit(r, lambda md: _first_storage(md, relative_path="../outside.distcp")), ".metadata",
        "../outside.distcp", name="dcp storage path escapes"),
    dcp(lambda r: _md_edit(r, lambda md: _first_storage(md, relative_path="/etc/passwd")), ".metadata",
        "/etc/passwd", name="dcp storage path absolute"),
    dcp(lambda r: _md_edit(r, lambda md: _first_storage(md, offset=-5)), ".metadata", "offset=-5",
        name="dcp storage offset negative"),
    dcp(lambda r: [_truncate(p, 300) for p in r.glob("*.distcp")], ".distcp", convert=True,
        name="dcp data truncated on convert"),
    # Megatron-Core torch_dist (saved by the engine with Megatron-LM's tracker)
    mcore(write("latest_checkpointed_iteration.txt", "../../etc"), "latest_checkpointed_iteration.txt",
          name="megatron tracker escapes"),
    mcore(write("latest_checkpointed_iteration.txt", "9999"), "latest_checkpointed_iteration.txt", "iter_0009999",
          name="megatron tracker names a missing iteration"),
    mcore(lambda s: (_iter(s) / "metadata.json").write_text("{oops"), "metadata.json", "not valid JSON",
          name="megatron metadata.json garbage"),
    mcore(lambda s: (_iter(s) / "metadata.json").write_text("[1, 2]"), "metadata.json", "list",
          name="megatron metadata.json a list"),
    mcore(lambda s: (_iter(s) / "common.pt").unlink(), "common.pt", name="megatron common.pt missing"),
    mcore(lambda s: _truncate(_iter(s) / "common.pt", 400), "common.pt", name="megatron common.pt truncated"),
    mcore(lambda s: torch.save([1], _iter(s) / "common.pt"), "common.pt", "list", name="megatron common.pt a list"),
    mcore(lambda s: (_iter(s) / ".metadata").unlink(), ".metadata", "missing", name="megatron .metadata missing"),
    mcore(lambda s: _truncate(_iter(s) / ".metadata", 200), ".metadata", name="megatron .metadata truncated"),
    mcore(lambda s: [p.unlink() for p in _iter(s).glob("*.distcp")], "missing", name="megatron data files missing"),
    # Megatron-LM legacy per-rank files (pp 2)
    legacy(lambda r: (r / "mp_rank_00_001" / "model_optim_rng.pt").unlink(), "mp_rank_00_001",
           name="legacy rank file missing"),
    legacy(lambda r: _truncate(r / "mp_rank_00_001" / "model_optim_rng.pt"), "mp_rank_00_001/model_optim_rng.pt",
           name="legacy rank file truncated"),
    legacy(_legacy_other_iteration, "disagree on iteration", "mp_rank_00_001", name="legacy rank from another save"),
    legacy(lambda r: (r / "mp_rank_00_001" / "distrib_optim.pt").unlink(), "distrib_optim.pt",
           name="legacy distrib_optim missing"),
    legacy(lambda r: _resave(r / "mp_rank_00_000" / "model_optim_rng.pt",
                             lambda s: {**s, "args": None}), "model_optim_rng.pt", name="legacy args missing"),
    # jobs (migrate validate)
    Case("job alias bomb", None, _job(BOMB), ("job.yaml", "alias")),
    Case("job nested 20,000 deep", None, _job("a: " + "[" * 20000 + "]" * 20000), ("job.yaml", "nested deeper")),
    Case("job duplicate key", None, _job("name: a\nname: b\n"), ("job.yaml", "given twice")),
    Case("job empty", None, _job(""), ("job.yaml", "empty")),
    Case("job a list", None, _job("- a\n- b\n"), ("job.yaml", "mapping")),
    Case("job not UTF-8", None, _job(b"name: \xff\xfe\n"), ("job.yaml",)),
    Case("job over the size limit", None, _job("# " + "x" * (1 << 21) + "\n"), ("job.yaml", "bytes")),
    Case("job invalid YAML", None, _job("name: [unclosed\n"), ("job.yaml", "invalid YAML")),
    Case("job a directory", None, lambda _s, tmp: ["validate", str(tmp)], ("is a directory",)),
    Case("job missing", None, lambda _s, tmp: ["validate", str(tmp / "nope.yaml")], ("nope.yaml", "not found")),
    # tolerances and metric files (migrate gate)
    Case("tolerances alias bomb", None, _tolerances(BOMB), ("tol.yaml", "alias")),
    Case("tolerances unknown key", None, _tolerances("nonsense: 1\n"), ("tol.yaml", "nonsense")),
    Case("tolerances not a mapping", None, _tolerances("- 1\n"), ("tol.yaml",)),
    Case("candidate missing", None, _gate_candidate("missing.jsonl", None), ("missing.jsonl",)),
    Case("candidate empty", None, _gate_candidate("empty.jsonl", b""), ("empty.jsonl",)),
    Case("candidate binary", None, _gate_candidate("bin.jsonl", bytes(range(256)) * 8), ("bin.jsonl",)),
    Case("candidate loss holds text", None, _gate_candidate("text.csv", (
        "step,loss\n" + "".join(f"{s},{2.0 - s / 100}\n" for s in range(1, 10)) + "10,oops\n").encode()),
         ("text.csv:11", "'oops'")),
    Case("candidate JSONL not objects", None, _gate_candidate("list.jsonl", b"[1, 2]\n[3, 4]\n"), ("list.jsonl:1",)),
    Case("baseline with NaN", None, lambda _s, tmp: _nan_baseline(tmp), ("base.jsonl", "NaN/Inf", "healthy")),
    # model configs and command-line numbers (migrate convert)
    Case("model config alias bomb", "deepspeed", _model_config(BOMB), ("model.yaml", "alias")),
    Case("model config a list", "deepspeed", _model_config("- 1\n- 2\n"), ("model.yaml", "not a mapping")),
    Case("--tp -1", "deepspeed", _cli("--to", "megatron", "--tp", "-1"), ("--tp", "-1")),
    Case("--dp 0", "deepspeed", _cli("--to", "deepspeed", "--dp", "0"), ("--dp", "0")),
    Case("--workers 0", "deepspeed", _cli("--to", "deepspeed", "--workers", "0"), ("--workers",)),
    Case("--zero-stage 7", "deepspeed", _cli("--to", "deepspeed", "--zero-stage", "7"), ("--zero-stage", "7")),
    Case("--to unknown", "deepspeed", _cli("--to", "tensorflow"), ("--to", "tensorflow")),
    Case("--resume and --overwrite", "deepspeed", _cli("--to", "dcp", "--resume", "--overwrite"),
         ("--resume", "--overwrite")),
    Case("destination is a file", "deepspeed",
         lambda src, tmp: (tmp / "file").write_text("x") and ["convert", str(src), str(tmp / "file"), "--to", "dcp"],
         ("file", "not empty")),
    Case("destination inside the source", "deepspeed",
         lambda src, tmp: ["convert", str(src), str(src / "converted"), "--to", "dcp"], ("inside the source",)),
    Case("source missing", None, lambda _s, tmp: ["inspect", str(tmp / "nowhere")], ("nowhere",)),
    Case("source of no known format", None, lambda _s, tmp: (tmp / "d").mkdir() or ["inspect", str(tmp / "d")],
         ("no known checkpoint format",)),
]


@pytest.fixture
def sources(request, tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            if name == "deepspeed":
                cache[name] = request.getfixturevalue("deepspeed_checkpoint")(2, 2).path
            elif name == "dcp":
                cache[name] = request.getfixturevalue("fsdp_checkpoint")(2).path
            elif name == "megatron":
                cache[name] = request.getfixturevalue("megatron_checkpoint")(1, 1, 2).path.parent
            elif name == "megatron_legacy":
                cache[name] = request.getfixturevalue("megatron_legacy_checkpoint")(1, 2, 1).path.parent
        return cache[name]

    return get


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 60 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_malformed_input_exits_2_with_one_line_and_writes_nothing(sources, tmp_path, case):
    work = tmp_path / "work"
    work.mkdir()
    src = tmp_path / "src"
    if case.source is not None:
        shutil.copytree(sources(case.source), src)
    else:
        src.mkdir()
    argv = case.make(src, work)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 2, f"{case.name}: exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    assert "Traceback" not in result.output and not isinstance(result.exception, Exception) or \
        isinstance(result.exception, SystemExit), f"{case.name}: {result.exception!r}"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"{case.name}: {len(lines)} lines:\n{result.stderr}"
    for needle in case.needles:
        assert needle in lines[0], f"{case.name}: {needle!r} not in {lines[0]!r}"
    assert not (work / "out").exists(), f"{case.name}: wrote {work / 'out'}"
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert after == before, f"{case.name}: files appeared: {set(after) - set(before)}"
