# Sourced by the GPU scripts of benchmarks/: the GPU image lacks some of omnistage's dependencies (pydantic,
# soundfile, the tokenizer...), so wheels in the repository's ignored .whl*/ folders, carried with the call,
# are installed into /tmp/site (SITE; WHEELS names the folders) and put on PYTHONPATH, with the repository
# (the scripts of benchmarks/ import omnistage): .whl/ and .whl-av/ (PyAV) from benchmarks/gpu_wheels.sh,
# .whl-ray/ from benchmarks/ray_wheels.sh (with Ray itself as an archive of its unpacked wheel, extracted
# there). Output is unbuffered so that a run cut short keeps its logs.
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SITE=${SITE:-/tmp/site}
WHEELS=${WHEELS:-.whl .whl-av .whl-ray}  # the folders, of those carried, to install from
wheels=() archives=()
for folder in $WHEELS; do
  for f in "$folder"/*.whl "$folder"/*.tar.xz; do
    case $f in
      *\**) ;;  # a pattern that matched nothing
      *.whl) wheels+=("$f") ;;
      *) archives+=("$f") ;;
    esac
  done
done
if ((${#wheels[@]})); then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" || exit
fi
for archive in "${archives[@]}"; do
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="tar")' "$archive" "$SITE" || exit
done
if ((${#wheels[@]} + ${#archives[@]})); then
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi

# The machine and the versions a run measured, for its $OUT/env.txt: `gpu_env_txt > "$OUT/env.txt"`. The host's
# CPU and load go with the GPU: two H100 machines served the same Qwen3-ASR run at 1,317-1,544 and 2,294-2,689
# audio seconds a second, a host-bound rate (benchmarks/RESULTS.md, "Qwen3-ASR at c=128 on two H100 hosts").
gpu_env_txt() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  echo "cpu $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)"
  python3 -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)' 2>&1
}
