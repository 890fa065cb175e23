"""Models, below every backend: building and loading Hugging Face models (`hf`: build_model, pick_device, pick_dtype,
token_logprobs, the reference definition), a .gguf model de-quantized once (`gguf_cache`), LoRA adapters on them
(`lora`: injection, adapter files, the rollout's merged or adapter-only state), weights in flat buffers
(`weight_buffers`), and their files on disk (`checkpoint_files`: safe reads; `write_errors`: plain write errors).
Import the submodule you need; nothing heavy is imported here.

Layer 3 of 0-9 (docs/design.md): imports Relax packages of lower layers only.
"""
