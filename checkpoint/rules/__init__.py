"""Architecture rules as data: how a framework's (sharded, fused, stacked) tensors map onto canonical names.

`checkpoint.rules.megatron` holds the rules for Megatron-Core's GPTModel (gpt, llama, mixtral).
"""
