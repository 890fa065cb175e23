"""Train and rollout backends. Import the submodule you need; nothing heavy is imported here.

- `relax.backends.batch`: Samples / TrainBatch, the tensors that move between roles.
- `relax.backends.models`: build_model, pick_device, pick_dtype, token_logprobs (the reference definition).
- `relax.backends.logprobs`: response_logprobs, the same log-probs in chunks (what the trainer and reference use).
- `relax.backends.gguf_cache`: a .gguf model de-quantized once and reloaded from safetensors.
- `relax.backends.trainer`: the trainer core both train backends share (the `Policy` protocol, `train_step`, the
  lr schedule, micro-batching, denominators, non-finite steps).
- `relax.backends.torch_train`: TorchPolicy, the embedded (single-device) policy trainer.
- `relax.backends.torch_critic`: TorchCritic, the embedded PPO critic.
- `relax.backends.torch_reference`: TorchReference, the frozen reference policy.
- `relax.backends.megatron`: MegatronPolicy, one rank of a TP x PP x DP trainer on megatron-core.
- `relax.backends.rollout_embedded`, `relax.backends.sglang`: the rollout engines.
- `relax.backends.checkpoint_files`, `relax.backends.write_errors`: safe reads, plain write errors of checkpoints.

Layer 3 of 0-6 (docs/design.md): imports Relax packages of lower layers only.
"""
