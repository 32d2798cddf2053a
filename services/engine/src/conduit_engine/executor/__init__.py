"""How a step reaches the model: in this process or in worker processes."""
