"""Precision techniques: bf16/fp16 autocast, int8."""
