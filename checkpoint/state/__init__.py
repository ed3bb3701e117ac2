"""Training state beyond tensors: RNG streams, the data position, scheduler and counters.

`rng` decides per target rank how its RNG state is obtained (carried, replicated from a DP
peer, or derived from (seed, step, coordinates)); `data_position` converts the dataloader
position so the global sample order continues exactly; `training_state` applies both to the
state dict a training run keeps next to its weights (for DeepSpeed: the client state under
`CLIENT_STATE_KEY`; for Megatron-Core: ours in `common.pt` plus Megatron-LM's per-(pp, tp) `rng_state`
objects, read and written through `rng.from_megatron` / `rng.to_megatron`) and returns a report
listing, per state, the policy applied and why;
`faults` holds the documented test hooks that break a converted state on purpose.
"""
