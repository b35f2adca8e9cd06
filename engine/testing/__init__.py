"""Tools for tests and benchmarks, never for serving: the simulated rank (sim) that speaks the
real protocol without a model, and the demo model built offline (demo_model)."""
