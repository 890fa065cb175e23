"""The rollout driver, in the driver process: the stream that generates each step's batch with the weights its mode
allows (`stream`: RolloutStream), the engines it drives (`engines`: the embedded replicas as Ray actors;
`sglang_engines`: SGLang servers behind the router), and the scoring beside generation (`scoring`)."""
