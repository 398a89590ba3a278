"""Sparsity techniques: weights that sparse kernels multiply faster (2:4 semi-structured)."""
