"""Train and rollout backends (layer 3). Import the submodule you need; nothing heavy is imported here.

- `relax.backends.batch`: Samples / TrainBatch, the tensors that move between roles.
- `relax.backends.models`: build_model, pick_device, pick_dtype, token_logprobs (the reference definition).
- `relax.backends.logprobs`: response_logprobs, the same log-probs in chunks (what the trainer and reference use).
- `relax.backends.gguf_cache`: a .gguf model de-quantized once and reloaded from safetensors.
- `relax.backends.torch_train`: TorchPolicy, the embedded (single-device) policy trainer.
- `relax.backends.torch_critic`: TorchCritic, the embedded PPO critic.
"""
