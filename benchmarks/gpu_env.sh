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
