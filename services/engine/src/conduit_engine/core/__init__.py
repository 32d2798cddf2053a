"""Torch-free state of the engine thread: sequences, the block manager, the scheduler."""
