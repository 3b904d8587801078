"""Applications built on the library: sweeps, benchmarks, the demo."""
