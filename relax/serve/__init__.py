"""What answers HTTP: the SGLang-compatible server of the embedded engine (`sglang/`: `relax-serve`, and the rollout
replicas of `rollout.sglang.server=embedded`), the OpenAI API in front of the engines and the training gateway
(`openai/`), and their shared HTTP answers (`http`).

Layer 6 of 0-9 (docs/design.md): imports Relax packages of lower layers only.
"""
