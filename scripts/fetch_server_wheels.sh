#!/usr/bin/env bash
# Wheels of the server's web stack for a GPU machine whose Python (3.12) lacks it and cannot
# reach a package index: downloaded here into .whl/ (ignored by git), installed there with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:.
# The image already has anyio, click, h11, httpx, idna, prometheus-client and sniffio.
set -euo pipefail
DEST=${1:-.whl}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
PACKAGES=(fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5
          typing-inspection==0.4.5 annotated-types==0.8.0 annotated-doc==0.0.7
          opentelemetry-api==1.45.2 typing_extensions==4.16.0 uvicorn==0.54.0
          pyzmq==27.3.0 msgspec==0.22.0
          # `muse train grpo` (muse[rl]); the image has psutil, safetensors and transformers.
          peft==0.21.2 accelerate==1.16.0)
PLATFORMS=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
           manylinux_2_17_x86_64 manylinux2014_x86_64 any; do
    PLATFORMS+=(--platform "$tag")
done
mkdir -p "$DEST"
for package in "${PACKAGES[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp \
        --python-version "$PYTHON_VERSION" "${PLATFORMS[@]}" -d "$DEST" "$package"
done
