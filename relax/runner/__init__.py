"""The controller: plans the service graph, starts roles on Ray, runs the training loop."""
