"""What the engine tests share: engines in threads, model factories, harnesses and simulators."""
