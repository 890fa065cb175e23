"""The OpenAI API in front of the rollout engines: the protocol, the chat format, sessions and the gateway."""
