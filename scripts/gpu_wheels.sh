#!/usr/bin/env bash
# Fetch the pure-Python wheels `make gpu-check ONLY=serve` needs on the CUDA image (which lacks them)
# into .whl/ (git-ignored through .git/info/exclude); name `.whl` in the device tool's `carry`.
set -eu
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl starlette==1.10.0 uvicorn==0.55.0
