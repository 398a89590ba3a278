"""Deployment: ONNX export with proof (`onnx.py`), and `overdrive export`'s formats (`formats.py`)."""
