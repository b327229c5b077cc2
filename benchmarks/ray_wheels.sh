#!/usr/bin/env bash
# Ray Serve for a GPU run, into the repository's ignored .whl-ray/ folder (carried with the call like .whl;
# benchmarks/gpu_env.sh installs both). Ray's wheel (79 MB) is over what one call carries with the rest, so it
# travels unpacked and recompressed (xz, ~21 MB) without what one node's Serve never loads: the Java workers'
# jars, the dashboard's web client, and Ray's libraries beside Serve (RLlib, Tune, Train, Data, LLM; only the
# dashboard's pages of Train and Data import theirs, where its optional dependencies are installed). Beside it,
# the wheels of what Ray and Serve import that the GPU image lacks (jsonschema and its parts, mmh3 for the
# consistent-hash router, grpcio-reflection), with the grpcio and protobuf that grpcio-reflection's generated
# code was built against (the rest of Serve's stack, FastAPI, uvicorn and websockets, is the server's own, in .whl/).
#
#   bash benchmarks/ray_wheels.sh                        # then carry ".whl-ray" in the device call
#   PY=3.11 DEST=.whl-ray311 bash benchmarks/ray_wheels.sh  # the same for this machine's Python (a CPU smoke run)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-3.12}
DEST=${DEST:-.whl-ray}
RAY=${RAY:-2.60.0}
tag=cp${PY/./}
mkdir -p "$DEST"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
  manylinux_2_5_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    "${platforms[@]}" -d "$1" "${@:2}"
}
download "$DEST" jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  grpcio-reflection==1.81.1 grpcio==1.85.3 protobuf==6.33.6 mmh3==5.3.1
archive=$DEST/ray-$RAY-$tag-serve.tar.xz
if [[ ! -f $archive ]]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  wheel=${RAY_WHEEL:-}
  if [[ -z $wheel ]]; then
    download "$work" "ray==$RAY"
    wheel=$(ls "$work"/ray-*.whl)
  fi
  mkdir "$work/tree"
  unzip -q "$wheel" -d "$work/tree"  # unzip keeps the executables' mode (raylet, gcs_server)
  rm -rf "$work"/tree/ray/{jars,dashboard/client/build,rllib,tune,train,data,llm}
  tar -C "$work/tree" -cf - . | xz -9 -T0 >"$archive.part"
  mv "$archive.part" "$archive"
fi
du -ch "$DEST"/* | tail -1
