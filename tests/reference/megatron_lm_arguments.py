"""Megatron-LM's own argument handling as the judge of emitted `pretrain_gpt.py` arguments.

Run as a script with the Megatron-LM 0.19.2 sources (the `megatron-core` 0.19.2 wheel, which carries
`megatron/training/arguments.py`) first on PYTHONPATH. Reads a JSON list of
``{"argv": [...], "world_size": N, "env": {name: value}}`` from stdin; for each runs `parse_args` then
`validate_args` exactly as `initialize_megatron` does, as rank 0 of N ranks on a Hopper-class device
(`get_device_arch_version` 9: the branch that asks for CUDA_DEVICE_MAX_CONNECTIONS=1 with TP or CP), in the
caller's environment with the request's `env` on top (restored after it); prints a JSON list of
``{"args": {name: value}}`` or ``{"error": "..."}``.

0.19.2 needs Python 3.12 and imports triton at module level; the torch CPU wheel here is for 3.11. So on
3.11: `typing.override` comes from typing_extensions, and `triton` (GPU kernels only, never called while
parsing) is an empty module, installed after torch has decided it has no triton.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import io
import json
import os
import sys
import types
import warnings


class _NoTriton(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`triton` and its submodules as empty modules whose every attribute is a no-op."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "triton":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        from unittest import mock

        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__, module.__name__, module.__version__ = [], spec, spec.name, "3.4.0"
        return module

    def exec_module(self, module):
        return None


def _import_arguments() -> types.ModuleType:
    import torch
    import torch._inductor.compile_fx  # decides "no triton" before the stub exists
    import torch.utils._triton
    import torch.utils.flop_counter
    import typing

    import typing_extensions

    torch.utils._triton.has_triton_package()
    torch.utils._triton.has_triton()
    if not hasattr(typing, "override"):
        typing.override = typing_extensions.override
    sys.meta_path.insert(0, _NoTriton())
    warnings.filterwarnings("ignore")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        from megatron.training import argument_utils, arguments
    arguments.get_device_arch_version = lambda: 9
    _remember_field_docstrings(argument_utils.ArgumentGroupFactory)
    return arguments


def _remember_field_docstrings(factory: type) -> None:
    """Each config class's field docstrings (the argparse help text, read from the class's source with `inspect`
    and `ast` anew on every `parse_args`: 0.2 s a call) read once per class; the arguments parsed are the same."""
    read = factory._get_field_docstrings
    known: dict[type, dict[str, str]] = {}

    def remembered(self, src_cfg_class: type) -> dict[str, str]:
        if src_cfg_class not in known:
            known[src_cfg_class] = read(self, src_cfg_class)
        return dict(known[src_cfg_class])

    factory._get_field_docstrings = remembered


def _jsonable(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def judge(arguments: types.ModuleType, argv: list[str], world_size: int, env: dict[str, str]) -> dict:
    saved = dict(os.environ)
    os.environ.update(env, WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0")
    sys.argv = ["pretrain_gpt.py", *argv]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            args = arguments.parse_args()
            arguments.validate_args(args, {})
    except SystemExit as exc:
        return {"error": f"parse_args exited {exc.code}: {out.getvalue().strip().splitlines()[-1:]}"}
    except AssertionError as exc:
        return {"error": f"validate_args: {exc}"}
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {"args": {k: _jsonable(v) for k, v in vars(args).items()}}


def main() -> None:
    requests = json.load(sys.stdin)
    arguments = _import_arguments()
    print(json.dumps([judge(arguments, r["argv"], r["world_size"], r.get("env", {})) for r in requests]))


if __name__ == "__main__":
    main()
