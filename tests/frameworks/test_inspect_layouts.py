"""`migrate inspect` states the layout a checkpoint was written at, for every format's parallel axes."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from migrate.cli import main

GBS = 12  # the global batch the Megatron conversion tests train with (shared session checkpoints)


def _inspect(path) -> dict:
    result = CliRunner().invoke(main, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.mark.slow
def test_inspect_reports_megatron_tensor_and_pipeline_sizes(megatron_checkpoint):
    tp2 = _inspect(megatron_checkpoint(2, 1, 1, global_batch_size=GBS).path)
    pp2 = _inspect(megatron_checkpoint(1, 2, 1, global_batch_size=GBS).path)
    assert tp2["format"] == "megatron" and (tp2["layout"]["tp"], tp2["layout"]["pp"]) == (2, 1)
    assert (pp2["layout"]["tp"], pp2["layout"]["pp"]) == (1, 2)
    text = CliRunner().invoke(main, ["inspect", str(megatron_checkpoint(2, 1, 1, global_batch_size=GBS).path)]).output
    assert "tp=2 pp=1" in text
