"""The embedded engine behind SGLang's HTTP protocol: the server (`server`), requests (`request`), the scheduler
(`scheduler`), weight and memory endpoints (`weights`), streams (`stream`), loads (`loads`), prompt log-probs
(`positions`). The client side is `relax.rollout.sglang`."""
