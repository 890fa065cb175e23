"""SGLang's HTTP protocol: the wire formats of weight updates and the embedded engine's SGLang-compatible server."""
