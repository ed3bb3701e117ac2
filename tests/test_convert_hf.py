"""Exporting weights to Hugging Face safetensors and importing them back, per architecture name map.

Sources are real DeepSpeed checkpoints (session fixture); the files are read back with the
`safetensors` library itself.
"""

import dataclasses

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from checkpoint.api import convert, detect_format, read_index
from checkpoint.errors import CheckpointFormatError
from checkpoint.formats.hf import NAME_MAPS, rename
from checkpoint.plan import summarize
from checkpoint.verify import compare_indexes
from migrate.workload.fixtures import TINY_LLAMA, TINY_MIXTRAL
from migrate.workload.torch_model import build_decoder

SPECS = {"llama": TINY_LLAMA, "mixtral": TINY_MIXTRAL, "gpt": dataclasses.replace(TINY_LLAMA, architecture="gpt")}
HF_EXAMPLES = {
    "llama": {"layers.1.self_attn.k_proj.weight": "model.layers.1.self_attn.k_proj.weight",
              "lm_head.weight": "lm_head.weight", "norm.weight": "model.norm.weight"},
    "mixtral": {"layers.0.mlp.experts.3.gate_proj.weight": "model.layers.0.block_sparse_moe.experts.3.w1.weight",
                "layers.0.mlp.experts.3.down_proj.weight": "model.layers.0.block_sparse_moe.experts.3.w2.weight",
                "layers.0.mlp.experts.3.up_proj.weight": "model.layers.0.block_sparse_moe.experts.3.w3.weight",
                "layers.1.mlp.gate.weight": "model.layers.1.block_sparse_moe.gate.weight"},
    "gpt": {"embed_tokens.weight": "transformer.wte.weight", "layers.1.input_layernorm.bias": "transformer.h.1.ln_1.bias",
            "layers.0.self_attn.o_proj.weight": "transformer.h.0.attn.attention.out_proj.weight",
            "layers.0.mlp.up_proj.weight": "transformer.h.0.mlp.c_fc.weight", "norm.bias": "transformer.ln_f.bias"},
}


@pytest.mark.parametrize("arch", sorted(NAME_MAPS))
def test_name_map_is_a_bijection_over_the_models_parameters(arch):
    names = list(build_decoder(SPECS[arch], 0).state_dict())
    hf = [rename(n, arch, to_hf=True) for n in names]
    assert len(set(hf)) == len(names)
    assert [rename(h, arch, to_hf=False) for h in hf] == names
    for canonical, expected in HF_EXAMPLES[arch].items():
        assert rename(canonical, arch, to_hf=True) == expected


def test_unknown_names_are_refused_with_the_name():
    with pytest.raises(CheckpointFormatError, match="rotary_emb"):
        rename("model.layers.0.self_attn.rotary_emb.inv_freq", "gpt", to_hf=False)


@pytest.mark.slow
def test_deepspeed_to_hf_and_back_is_bit_exact(deepspeed_checkpoint, tmp_path):
    src = deepspeed_checkpoint(2, 1).path
    out = convert(src, tmp_path / "hf", to="hf")
    assert detect_format(tmp_path / "hf") == "hf"
    source = read_index(src)
    assert compare_indexes(source, read_index(tmp_path / "hf")) == []
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.weight" in weights and "lm_head.weight" in weights
    assert len(weights) == len(out.plan.target.index.entries)
    # HF -> DeepSpeed ZeRO-3 at dp 2 (weights only, said so) -> HF: the same tensors
    back = convert(tmp_path / "hf", tmp_path / "ds", to="deepspeed", dp=2, zero_stage=3)
    assert "optimizer state: ABSENT in the source" in summarize(back.plan)
    assert not any(str(e.key.kind).startswith("exp_avg") for e in read_index(tmp_path / "ds").entries)
    convert(tmp_path / "ds", tmp_path / "hf2", to="hf")
    again = load_file(tmp_path / "hf2" / "model.safetensors")
    assert sorted(again) == sorted(weights) and all(torch.equal(again[k], weights[k]) for k in weights)
    with safe_open(str(tmp_path / "hf2" / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["migrate_architecture"] == "llama"
