"""The client side of SGLang's HTTP protocol: requests and answers (`client`), the wire formats of weight updates
(`wire`), weights from the trainer to the servers (`weight_sync`), the sglang-router (`router`), server processes
(`process`), and agentic episodes over HTTP (`episodes`). What answers that protocol is `relax.serve.sglang`."""
