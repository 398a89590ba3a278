"""Batching techniques (how samples are grouped into batches)."""
