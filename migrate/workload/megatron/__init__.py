"""The built-in decoder trained by Megatron-Core (`engine`), and Megatron-LM's two checkpoint formats it saves
and loads: `dist_format` (`--ckpt-format torch_dist`) and `legacy_format` (`--ckpt-format torch`), with what
they share in `state`. `engine.CHECKPOINT_FORMATS` is the save/load table; `cpu_adapter` runs Megatron-Core on
the CPU (Gloo), where it assumes CUDA."""
