"""Multi-device techniques: a model split across GPUs."""
