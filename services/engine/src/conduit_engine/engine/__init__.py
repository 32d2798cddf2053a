"""The request lifecycle and the step loop."""
