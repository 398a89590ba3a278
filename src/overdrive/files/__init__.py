"""Formats below every verb: users' input records (inputs, tensor_sources) and the ONNX export (onnx)."""
