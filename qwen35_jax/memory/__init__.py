"""Per-device memory of the whole train step: compile-time analysis and an analytic per-token budget."""
