"""Generation: the embedded rollout engine (`embedded`: a batched sampler with a KV cache), its sampling (`sampling`),
and the client side of SGLang's HTTP protocol (`sglang/`: client, wire formats, weight sync, router, server
processes, episodes over HTTP). Import the submodule you need; nothing heavy is imported here.

Layer 4 of 0-9 (docs/design.md): imports Relax packages of lower layers only.
"""
