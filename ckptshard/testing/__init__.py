"""Real fairscale checkpoints for tests, the demo and benchmarks."""
