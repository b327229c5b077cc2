# Sourced by the GPU scripts of benchmarks/: the GPU image lacks some of omnistage's dependencies (pydantic,
# soundfile, the tokenizer...), so wheels in the repository's ignored .whl/ folder (benchmarks/gpu_wheels.sh
# downloads them), carried with the call, are installed into /tmp/site and put on PYTHONPATH, with the
# repository (the scripts of benchmarks/ import omnistage); output is unbuffered so that a run cut short keeps
# its logs.
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# The machine and the versions a run measured, for its $OUT/env.txt: `gpu_env_txt > "$OUT/env.txt"`.
gpu_env_txt() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  python3 -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)' 2>&1
}
