"""Training: the trainer core both train backends share (`trainer`: the `Policy` protocol, `train_step`, the lr
schedule, micro-batching, denominators, non-finite steps), the torch backend (`torch_policy`: TorchPolicy;
`torch_critic`: the PPO critic; `torch_reference`: the frozen reference and teacher), the trainer's log-probs in chunks
(`logprobs`), packing (`packing`), megatron-core (`megatron/`), and a checkpoint exported as a Hugging Face directory
(`export`). Import the submodule you need; nothing heavy is imported here.

Layer 5 of 0-9 (docs/design.md): imports Relax packages of lower layers only.
"""
