"""Deployment: `overdrive export`'s formats (`formats.py`); the ONNX export itself is `overdrive.files.onnx`."""
