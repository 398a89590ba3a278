"""Runtime techniques: torch.compile, inference mode."""
