#!/usr/bin/env bash
# The GPU measurements of issues 27 and 29 in one call, issue 29's still open (benchmarks/RESULTS.md,
# "For the next GPU session"):
#
#   OUT=$OUT bash benchmarks/pending.sh [STEP...]     # on the GPU machine; carry .whl-lite and .whl-av
#
# Steps (all, in this order, when none is named):
# - http:       item 2 through HTTP, the colocated topology capped at 80 GiB (benchmarks/http_load.sh, T2S at
#               c = 16 and 64, 3 passes each, no soak);
# - inproc:     item 2 in-process with the same configuration and cap (benchmarks/under_load.sh's T2S part and
#               its S2S at c = 1);
# - video_host: the host's share of a 30 s 720p video on all the machine's cores (benchmarks/video_host.py), on
#               this tree and on .ab's where it is carried;
# - video:      issue 29's targets, 30 s at c = 1 and 10 s at c = 8, with the default per-step budget, then
#               with 8,192 tokens a step (benchmarks/video.sh, no baseline, KV_GIB=4 as the earlier rows);
# - video_kv:   the same with 8,192 tokens a step and 32 GiB of KV (an H200: the 4 GiB pool holds 42k tokens,
#               fewer than eight 10 s videos' 59k), in 300 s: a fresh machine's first start builds its kernels;
# - asr:        Qwen3-ASR 0.6B and 1.7B at c = 128 (item 4's targets on this card; benchmarks/under_load.sh);
# - asr_budget: the 0.6B at c = 128 with 2,048, 4,096 and 8,192 tokens a step (prefill graphs to the same):
#               arrivals come in waves of up to 128 prompts, which a 2,048-token step takes in several;
# - asr_burst:  the 0.6B at c = 128 as before, then with `--count-preparing` (each request counted as being prepared
#               until it goes in, as the server counts them: an idle engine holds a wave for its last request),
#               one host: the waves' admission one at a time or whole;
# - asr_dense:  the 0.6B at c = 128 with the audio tower's graphs and eagerly (`--max-audio-graph-windows 0`), in
#               turn, twice: the tower's calls were 540 of the 880 ms the Thinker waited in a trace (fdc38ef, whose
#               graphs gave each window a slot of 8 chunks; asr_ab against .ab at fdc38ef measures the packing);
# - asr_2min:   Qwen3-ASR 0.6B and 1.7B on 2-minute clips at c = 64 (400 tokens forced, each request its own
#               clip) beside transformers one request at a time on the same weights (item 4's second half);
# - trace_video: a 30 s 720p video with its sound at c = 1 under benchmarks/step_trace.py (two requests, KV_GIB
#               4 as `video`): each step of each stage and the hand-off between the first token and the first
#               packet (~490 ms of the 30 s video's 2.5 s on an H100, its Talker prompt 22k rows);
# - baseline:   transformers' T2S and S2S beside ours at c = 1 and 16 on the same weight tensors, one process
#               with the engine's default sizing (the 80 GiB cap leaves no room for a second model's working
#               memory), for the rows above to have a baseline from the same machine (an H200: on an 80 GB
#               card the engine's default plan alone asks 90 GiB);
# - spy_asr:    the 0.6B at c = 128 under py-spy (benchmarks/spy.sh; carry .whl-spy too): where the host's
#               time goes when the GPU waits;
# - handoff:    the speech hand-off's GPU test (a burst's Talker prompts built without waiting for the device),
#               then T2S at c = 16 and 64 under benchmarks/step_trace.py, colocated at 80 GiB: the gap between
#               a burst's Thinker prefill and its Talkers' (87 ms for 64 before e14c76c);
# - long_prefill: the GPU tests of the long-prefill path (torch's FlashAttention over gathered keys equals the
#               paged kernel) and of the hand-off's prompts;
# - video_flash: 30 s and 10 s videos at c = 1 and 8 with the long-prefill path (the default), then the 30 s one
#               at c = 1 with `--no-flash-prefill`: before and after in one call (KV_GIB=4, as `video`);
# - moe_sweep:  the Thinker's and the Talker's MoE layers at 2,048 and 8,192 tokens with each candidate tile
#               (moe_kernels.py --sweep, those with a block's N tiles side by side among them; the prefill tiles
#               were chosen on the Thinker's alone).
# - moe_e2e:    eight 10 s videos at once with the routed experts on torch's grouped GEMMs, then on the Triton kernel
#               (`--moe-kernel grouped_mm`, then auto: the Triton kernel at every size since 7b65d02), 8,192
#               tokens a step, 5.8 GiB of KV (32 on an H200).
# - sdpa_video: a 10 s video's whole prompt (8,192 and 7,353 rows) through torch's SDPA backends beside the varlen
#               FlashAttention (benchmarks/sdpa_long.py --rows), each backend's first call of a row count timed:
#               whether cuDNN's plans, built per shape, pay for fresh prompts.
# - sdpa_padded: fresh prompts of 7,353, 7,400, 7,000, 2,048 and 2,001 rows through cuDNN padded to a multiple of
#               512 rows (benchmarks/sdpa_long.py --pad-to), beside the varlen FlashAttention: whether one plan a
#               bucket keeps cuDNN's 1.7-1.95x once its first call per bucket is paid, and the padding exact.
# - long_attention: a long prompt's 2,048-row chunks after 0, 10k and 20k tokens in our paged kernel beside
#               torch's FlashAttention (benchmarks/prefill_attention.py --long): a 30 s video's prefill took
#               2-3 times its FLOPs' time, attention half of those FLOPs.
# - admission:  the GPU tests of admitting new media without waiting for the device (the towers' inputs, the
#               encoder cache's and the prefix keys' copies) and of the tests beside them;
# - asr_ab:     Qwen3-ASR 0.6B at c = 64 and 128 on the tree exported to .ab (carry it) and on this one
#               (benchmarks/before_after.sh run asr);
# - mel:        the GPU tests of the clips' features made by the encoder stage at admission (the mel on the
#               engine's stream, equal to the CPU's, the same bits anywhere in a batch, nothing waited for) and of
#               the admission, caches and Qwen3-ASR engine around it;
# - video_ab:   eight 10 s videos at once on the tree exported to .ab (carry it; fc1e851 for the videos encoded
#               two steps ahead of the prefill and decoded one a core) and on this one (before_after.sh run
#               video; 32 GiB of KV on a card over 100 GiB, 5.8 below: the most an 80 GB card starts with, room
#               for the eight prompts without preemption);
# - sync_asr:   the 0.6B at c = 128 under benchmarks/sync_points.py: every call that waits for the device,
#               by thread and site (`sync_asr_before`: the same over the tree exported to .ab);
# - asr_profile: the 0.6B's decode steps of 128 rows, and loaded ones (two clips encoded and prefilled beside
#               them), under torch.profiler (benchmarks/decode_profile.py --arrivals 2);
# - admission_host: the host's share of admitting one Qwen3-ASR prompt outside the tower (its prefix keys and
#               placeholder rows) and of keying a 30 s video's Talker prompt (benchmarks/admission_host.py), on
#               this tree and on .ab's where it is carried;
# - trace_asr:  the 0.6B at c = 128 under benchmarks/step_trace.py: each step's class, rows and time, then the
#               gaps between its steps split into admissions, encoding and the rest (benchmarks/trace_gaps.py;
#               TRACE_ARGS: more `bench a2t` flags, e.g. --count-preparing; TRACE_FLAGS=--no-sync: the host's
#               times alone, the device left to overlap them as it does untraced);
# - engine_asr: the 0.6B at c = 128 with the engine's thread under cProfile and every thread's CPU time
#               (benchmarks/engine_profile.py), then under py-spy sampling only the thread that holds the
#               interpreter's lock (spy.sh with SPY_ARGS=--gil; carry .whl-spy too): where the host's time goes;
# - decode_attention: a decode step's attention a layer by KV splits and through the prefill tiles
#               (benchmarks/decode_attention.py), Qwen3-ASR's 128 rows of 100-token contexts among the cases.
# - prefill_kernels: a long prompt's 2,048-row chunks through torch's SDPA backends (cuDNN among them) beside the
#               engine's varlen FlashAttention (benchmarks/sdpa_long.py), and the routed experts' grouped GEMMs
#               against the Triton kernel at prefill sizes (benchmarks/moe_kernels.py --tokens 128,...,8192,
#               TFLOP/s; then the grouped path compiled, as the engine's layers run it): the two halves of a 30 s
#               video's prefill, each against what else torch runs.
# - video_turns: the 30 s and 10 s videos at c = 1 (two requests each, KV_GIB=4), each request a chat's first turn
#               about a video of its own, then its second turn (`--follow-up`: the videos kept decoded, the towers'
#               rows and the prefix pages serve it), both timed (300 s: a fresh machine's first start builds its
#               kernels, and 175 s cut the run on host r before it printed);
# - vision_cache: the encoder cache's GPU tests (a kept clip, a kept video: encoded and keyed without a wait);
# - pinned:     what a pinned host buffer of a video's vision rows, or of a clip's, costs the engine's thread
#               (benchmarks/pinned_alloc.py): torch's default, registered by 8 threads, and omnistage's (a reserve);
# - talker_budget: the 30 s and 10 s videos at c = 1 (two requests each, KV_GIB=4) with the Talker's step budget
#               the engine's 2,048 rows, then 8,192 (`--talker-max-num-batched-tokens`, its default since
#               86420bc): the 30 s video's 22k-row Talker prompt in 11 steps or 3.
# - video_at_once: eight distinct 10 s videos decoded at once as the server decodes them, at most 8, 4, 2 and 1 at a
#               time, from 2 and 30 fps sources (benchmarks/video_at_once.py; host only): whether one video a core
#               (`media.VIDEO_DECODES_AT_ONCE`, 16 here) is the right bound on a GPU host too.
# - moe_ab:     the routed experts at 512, 2,048 and 8,192 tokens compiled as the engine's layers run them, on this
#               tree and on .ab's (benchmarks/moe_kernels.py --compile): the prefill path's alignment by a stable
#               sort against the one-hot cumulative sum it replaced, and the two grouped GEMMs alone; then the
#               Triton kernel's taller tiles at 2,048 and 8,192 tokens (--sweep), now that it aligns by the sort too.
# - long_triton: the long-prefill path's GPU tests (torch's FlashAttention and omnistage's Triton kernel each equal
#               to the paged kernel; the Triton kernel equal to FlashAttention on ragged sequences), then one chunk of
#               2,048 and 8,192 rows after 0, 10k and 20k keys through the varlen FlashAttention, the Triton kernel
#               with each candidate tile, cuDNN and cuDNN split (benchmarks/sdpa_long.py --triton-sweep).
# - long_e2e:   a 30 s video at c = 1, three requests, with the long prompt chunks on torch's FlashAttention,
#               then on the Triton kernel (`--long-prefill-kernel flash`, then triton; KV_GIB=4 as `video`): its
#               22k-token prefill is where attention weighs most.
# Each step's files go under $OUT/<step>/ and everything measured so far is packed into $OUT/pending.tgz after
# each step, so that a call cut short at its limit still brings back what ran (a call returns only a few files).
# A step starts only while BUDGET_S seconds (540) less its own estimate are left since the script began;
# ESTIMATES="NAME=S ..." replaces a step's estimate (with a shorter run of it: TURN_LENGTHS=30 for video_turns'
# lengths, KV_LENGTHS and KV_C for video_kv's lengths and concurrencies, e.g. KV_LENGTHS=10 KV_C=8).
# A step named `h200:NAME` runs only on a card of over 100 GB and `h100:NAME` only on a smaller one, so that one
# command serves whichever card a call gets: `pending.sh video_turns h200:video_kv h100:pinned`.
# A fresh machine's first engine start builds every compiled kernel (~250 s against ~95 s warm): the steps keep
# torch's and Triton's kernel caches in one folder, which the call brings back as $OUT/kernels.tar.xz (when it
# fits the 16 MiB a file may take), and which a later call carrying .kcache/ (that file copied there) starts
# from. The caches key every kernel by its source and the machine's versions: a stale one is built again.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-pending-out}
BUDGET_S=${BUDGET_S:-540}
work=$(mktemp -d)
mkdir -p "$OUT"
export WHEELS=${WHEELS:-.whl-lite .whl-av}
source benchmarks/gpu_env.sh
export WHEELS=" "  # installed once: the scripts below source gpu_env.sh again and skip it
kernels=/tmp/kernel-cache
mkdir -p "$kernels"
if [ -f .kcache/kernels.tar.xz ]; then
  tar xJf .kcache/kernels.tar.xz -C "$kernels" && echo "pending: kernels from .kcache, $(du -sh "$kernels" | cut -f1)"
fi
export TORCHINDUCTOR_CACHE_DIR=$kernels/inductor TRITON_CACHE_DIR=$kernels/triton
{ gpu_env_txt; git rev-parse HEAD 2>/dev/null; } >"$work/env.txt"
cat "$work/env.txt"

# step NAME ESTIMATE_S COMMAND...: COMMAND with OUT=$work/NAME if ESTIMATE_S fits in what is left, then packed.
step() {
  local name=$1 estimate=$2 e
  shift 2
  for e in ${ESTIMATES:-}; do [[ ${e%%=*} == "$name" ]] && estimate=${e#*=}; done
  if ((SECONDS + estimate > BUDGET_S)); then
    echo "pending: $name left out (${estimate} s estimated, $((BUDGET_S - SECONDS)) s left)"
    return
  fi
  echo "pending: $name at ${SECONDS} s"
  OUT=$work/$name "$@"
  tar czf "$OUT/pending.tgz" -C "$work" .
}

colocated80="--config configs/qwen3omni_colocated.yaml --gpu-memory-limit-gib 80"
card=h100
nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{exit !($1 > 100000)}' && card=h200
for name in ${*:-http inproc video_host video asr baseline}; do
  if [[ $name == h100:* || $name == h200:* ]]; then
    [[ ${name%%:*} == "$card" ]] || { echo "pending: $name left out (the card is an $card)"; continue; }
    name=${name#*:}
  fi
  case $name in
    http) step http 250 env SOAK_N=0 T2S_C=16,64 T2S_REPEATS=3 T2S_S=150 bash benchmarks/http_load.sh ;;
    inproc) step inproc 220 env ASR=" " T2S_C=16,64 T2S_REPEATS=3 SPEECH_S=200 T2S_ARGS="$colocated80" \
      bash benchmarks/under_load.sh ;;
    video_host) step video_host 80 sh -c 'mkdir -p "$OUT" && { timeout 40 python3 benchmarks/video_host.py --runs 5; [ -d .ab ] &&
      PYTHONPATH="$PWD/.ab:$PYTHONPATH" timeout 40 python3 benchmarks/video_host.py --runs 5; } 2>&1 | tee "$OUT/video_host.txt"' ;;
    video)
      step video 230 env LENGTHS=30,10 C=1,8 BASELINE=0 KV_GIB=4 V2S_S=220 bash benchmarks/video.sh
      step video_8192 230 env LENGTHS=30,10 C=1,8 BASELINE=0 KV_GIB=4 V2S_S=220 \
        V2S_ARGS="--max-num-batched-tokens 8192" bash benchmarks/video.sh ;;
    video_kv) step video_kv 310 env LENGTHS="${KV_LENGTHS:-30,10}" C="${KV_C:-1,8}" BASELINE=0 KV_GIB=32 V2S_S=300 \
      V2S_ARGS="--max-num-batched-tokens 8192" bash benchmarks/video.sh ;;
    asr) step asr 230 env ASR="0.6b:128 1.7b:128" T2S_C=" " A2T_ARGS="--rounds 16" A2T_S=110 \
      bash benchmarks/under_load.sh ;;
    asr_budget) for tokens in 2048 4096 8192; do
        step "asr_budget_$tokens" 95 env ASR="0.6b:128" T2S_C=" " A2T_S=90 TAG="_b$tokens" A2T_ARGS="--rounds 16 \
          --max-num-batched-tokens $tokens --max-prefill-graph-tokens $tokens" bash benchmarks/under_load.sh
      done ;;
    asr_burst)
      step asr_burst_off 95 env ASR="0.6b:128" T2S_C=" " A2T_S=90 TAG="_burst_off" A2T_ARGS="--rounds 16" \
        bash benchmarks/under_load.sh
      step asr_burst_on 95 env ASR="0.6b:128" T2S_C=" " A2T_S=90 TAG="_burst_on" \
        A2T_ARGS="--rounds 16 --count-preparing" bash benchmarks/under_load.sh ;;
    asr_dense)
      for round in 1 2; do
        step "asr_graphs_$round" 95 env ASR="0.6b:128" T2S_C=" " A2T_S=90 TAG="_graphs_$round" A2T_ARGS="--rounds 16" \
          bash benchmarks/under_load.sh
        step "asr_dense_$round" 95 env ASR="0.6b:128" T2S_C=" " A2T_S=90 TAG="_dense_$round" \
          A2T_ARGS="--rounds 16 --max-audio-graph-windows 0" bash benchmarks/under_load.sh
      done ;;
    asr_2min) step asr_2min 330 env ASR="0.6b:64 1.7b:64" T2S_C=" " A2T_S=160 TAG=_2min \
      A2T_ARGS="--synth 2min --output-tokens 400 --rounds 2 --baseline transformers" bash benchmarks/under_load.sh ;;
    trace_video) step trace_video 300 sh -c 'mkdir -p "$OUT" && timeout 300 python3 benchmarks/step_trace.py \
      --out "$OUT/trace_video.json" -- bench v2s --load-format dummy --device cuda --dtype bfloat16 \
      --video-seconds 30 --resolution 1280x720 --concurrency 1 --requests 2 --text-tokens 40 --frames 125 \
      --kv-cache-memory-gib 4 --out-dir "$OUT/v2s" >"$OUT/trace_video.log" 2>&1; grep -E "^\| " "$OUT/trace_video.log"' ;;
    baseline) step baseline 200 sh -c 'mkdir -p "$OUT" && timeout 200 python3 -m omnistage.cli bench t2s \
      --load-format dummy --device cuda --dtype bfloat16 --concurrency 1,16 --requests 3 --also s2s \
      --also-concurrency 1 --baseline transformers --baseline-requests 1 --out-dir "$OUT" >"$OUT/speech_bench.log" 2>&1;
      grep -E "^\| " "$OUT/speech_bench.log"' ;;
    spy_asr) step spy_asr 130 env WHEELS=.whl-spy RATE=50 bash benchmarks/spy.sh bench a2t --load-format dummy \
      --skeleton qwen3-asr-0.6b --device cuda --concurrency 128 --rounds 8 --repeats 1 ;;
    handoff) step handoff 340 sh -c 'mkdir -p "$OUT" && bash benchmarks/gpu_tests.sh tests/gpu/test_talker_prompts_gpu.py
      timeout 300 python3 benchmarks/step_trace.py --out "$OUT/trace_t2s.json" -- bench t2s --load-format dummy \
      --device cuda --dtype bfloat16 --concurrency 16,64 --requests 2 --repeats 2 '"$colocated80"' \
      --out-dir "$OUT/t2s" >"$OUT/trace_t2s.log" 2>&1; grep -E "^\| " "$OUT/trace_t2s.log"' ;;
    long_prefill) step long_prefill 90 sh -c 'mkdir -p "$OUT" && bash benchmarks/gpu_tests.sh \
      tests/gpu/test_long_prefill_gpu.py tests/gpu/test_talker_prompts_gpu.py' ;;
    video_flash)
      # a fresh machine's first engine start builds every kernel (~250 s against ~95 s warm): this one may be it
      step video_flash 340 env LENGTHS=30,10 C=1,8 BASELINE=0 KV_GIB=4 V2S_S=340 bash benchmarks/video.sh
      step video_paged 160 env LENGTHS=30 C=1 BASELINE=0 KV_GIB=4 V2S_S=150 V2S_ARGS="--no-flash-prefill" \
        bash benchmarks/video.sh ;;
    admission) step admission 130 sh -c 'PER_FILE_S=120 bash benchmarks/gpu_tests.sh tests/gpu/test_admission_sync_gpu.py \
      tests/gpu/test_encoder_cache_gpu.py tests/gpu/test_prefix_keys_gpu.py tests/gpu/test_media_hold_gpu.py' ;;
    asr_ab) step asr_ab 310 env ASR_S=150 bash benchmarks/before_after.sh run asr ;;
    mel) step mel 200 sh -c 'PER_FILE_S=100 bash benchmarks/gpu_tests.sh tests/gpu/test_mel_gpu.py \
      tests/gpu/test_admission_sync_gpu.py tests/gpu/test_encoder_cache_gpu.py tests/gpu/test_prefix_keys_gpu.py \
      tests/gpu/test_asr_gpu.py' ;;
    video_ab) kv=5.8
      [[ $card == h200 ]] && kv=32
      step video_ab 420 env KV_GIB=$kv VIDEO_S=205 bash benchmarks/before_after.sh run video ;;
    sync_asr) step sync_asr 110 sh -c 'mkdir -p "$OUT" && timeout 110 python3 benchmarks/sync_points.py \
      --out "$OUT/sync_asr.json" -- bench a2t --load-format dummy --skeleton qwen3-asr-0.6b --device cuda \
      --concurrency 128 --rounds 4 --repeats 1 >"$OUT/sync_asr.log" 2>&1; tail -60 "$OUT/sync_asr.log"' ;;
    sync_asr_before) step sync_asr_before 110 sh -c 'mkdir -p "$OUT" && PYTHONPATH="$PWD/.ab:$PYTHONPATH" \
      timeout 110 python3 benchmarks/sync_points.py --out "$OUT/sync_asr.json" -- bench a2t --load-format dummy \
      --skeleton qwen3-asr-0.6b --device cuda --concurrency 128 --rounds 4 --repeats 1 >"$OUT/sync_asr.log" 2>&1;
      tail -45 "$OUT/sync_asr.log"' ;;
    asr_profile) step asr_profile 200 sh -c 'mkdir -p "$OUT" && timeout 200 python3 benchmarks/decode_profile.py \
      --skeleton qwen3-asr-0.6b --seconds 5 --batch 128 --arrivals 2 --out-dir "$OUT" >"$OUT/profile.log" 2>&1;
      grep -A24 "host call" "$OUT/profile.log"' ;;
    admission_host) step admission_host 20 sh -c 'mkdir -p "$OUT" && { python3 benchmarks/admission_host.py; [ -d .ab ] &&
      PYTHONPATH="$PWD/.ab:$PYTHONPATH" python3 benchmarks/admission_host.py; } 2>&1 | tee "$OUT/admission_host.txt"' ;;
    trace_asr) step trace_asr 110 sh -c 'mkdir -p "$OUT" && timeout 110 python3 benchmarks/step_trace.py \
      $TRACE_FLAGS --out "$OUT/trace_asr.json" -- bench a2t --load-format dummy --skeleton qwen3-asr-0.6b --device cuda \
      --concurrency 128 --rounds 4 --repeats 1 $TRACE_ARGS >"$OUT/trace_asr.log" 2>&1; grep -E "^\| " "$OUT/trace_asr.log"
      python3 benchmarks/trace_gaps.py "$OUT/trace_asr.json" | tee "$OUT/trace_asr_gaps.txt"' ;;
    engine_asr) step engine_asr 200 sh -c 'mkdir -p "$OUT" && timeout 110 python3 benchmarks/engine_profile.py \
      --out "$OUT/engine_profile.json" -- bench a2t --load-format dummy --skeleton qwen3-asr-0.6b --device cuda \
      --concurrency 128 --rounds 4 --repeats 1 >"$OUT/engine_profile.log" 2>&1; grep -v " INFO " "$OUT/engine_profile.log" | tail -70
      OUT="$OUT/gil" WHEELS=.whl-spy RATE=200 SPY_ARGS=--gil timeout 90 bash benchmarks/spy.sh bench a2t --load-format dummy \
      --skeleton qwen3-asr-0.6b --device cuda --concurrency 128 --rounds 4 --repeats 1' ;;
    vision_cache) step vision_cache 70 sh -c 'PER_FILE_S=65 bash benchmarks/gpu_tests.sh tests/gpu/test_encoder_cache_gpu.py' ;;
    pinned) step pinned 45 sh -c 'mkdir -p "$OUT" && { timeout 15 python3 benchmarks/pinned_alloc.py; \
      PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8 timeout 15 \
      python3 benchmarks/pinned_alloc.py; PYTORCH_CUDA_ALLOC_CONF=$(python3 -c "import omnistage; \
      print(omnistage.PINNED_HOST_MEMORY)") timeout 15 python3 benchmarks/pinned_alloc.py; } 2>&1 | tee "$OUT/pinned.txt"' ;;
    video_turns) step video_turns 300 env LENGTHS="${TURN_LENGTHS:-30,10}" C=1 REQUESTS=2 BASELINE=0 KV_GIB=4 V2S_S=295 \
      V2S_ARGS="--follow-up" bash benchmarks/video.sh ;;
    talker_budget) for tokens in 2048 8192; do
        step "talker_budget_$tokens" 200 env LENGTHS=30,10 C=1 REQUESTS=2 BASELINE=0 KV_GIB=4 V2S_S=195 \
          V2S_ARGS="--talker-max-num-batched-tokens $tokens" bash benchmarks/video.sh
      done ;;
    prefill_kernels) step prefill_kernels 220 sh -c 'mkdir -p "$OUT" && timeout 60 python3 benchmarks/sdpa_long.py \
      --out "$OUT/sdpa_long.json" 2>&1 | tee "$OUT/sdpa_long.txt"; timeout 90 python3 benchmarks/moe_kernels.py \
      --tokens 128,512,2048,8192 2>&1 | tee "$OUT/moe_prefill.txt" | grep -E "^\|"; timeout 60 python3 \
      benchmarks/moe_kernels.py --tokens 2048,8192 --compile 2>&1 | tee "$OUT/moe_compiled.txt" | grep -E "^\|"' ;;
    decode_attention) step decode_attention 120 sh -c 'mkdir -p "$OUT" && timeout 120 python3 \
      benchmarks/decode_attention.py --out "$OUT/decode_attention.json" 2>&1 | tee "$OUT/decode_attention.log"' ;;
    video_at_once) step video_at_once 150 sh -c 'mkdir -p "$OUT" && for fps in 2 30; do timeout 70 python3 \
      benchmarks/video_at_once.py --videos 8 --seconds 10 --source-fps $fps --at-once 8,4,2,1; done 2>&1 |
      tee "$OUT/video_at_once.txt"' ;;
    moe_ab) step moe_ab 330 sh -c 'mkdir -p "$OUT" && timeout 140 python3 benchmarks/moe_kernels.py \
      --tokens 512,2048,8192 --compile 2>&1 | tee "$OUT/moe_after.txt" | grep -E "^\|"; timeout 90 python3 \
      benchmarks/moe_kernels.py --tokens 2048,8192 --sweep 2>&1 | tee "$OUT/moe_sweep.txt" | grep -E "^\|"; \
      [ -d .ab ] && PYTHONPATH="$PWD/.ab:$PYTHONPATH" timeout 140 python3 benchmarks/moe_kernels.py \
      --tokens 512,2048,8192 --compile 2>&1 | tee "$OUT/moe_before.txt" | grep -E "^\|"' ;;
    moe_sweep) step moe_sweep 160 sh -c 'mkdir -p "$OUT" && for stage in thinker talker; do timeout 75 python3 \
      benchmarks/moe_kernels.py --stage $stage --tokens 2048,8192 --sweep 2>&1 | tee "$OUT/moe_$stage.txt" |
      grep -E "^\|"; done' ;;
    moe_e2e) kv=5.8
      [[ $card == h200 ]] && kv=32
      for kernel in grouped_mm auto; do
        step "moe_e2e_$kernel" 200 env LENGTHS=10 C=8 BASELINE=0 KV_GIB=$kv V2S_S=195 \
          V2S_ARGS="--moe-kernel $kernel --max-num-batched-tokens 8192" bash benchmarks/video.sh
      done ;;
    long_triton) step long_triton 270 sh -c 'mkdir -p "$OUT" && PER_FILE_S=90 bash benchmarks/gpu_tests.sh \
      tests/gpu/test_long_prefill_gpu.py; timeout 170 python3 benchmarks/sdpa_long.py --rows 2048,8192 \
      --cached 0,10000,20000 --triton-sweep --kernels "varlen,triton,cudnn,cudnn split" \
      --out "$OUT/sdpa_triton.json" 2>&1 | grep -v Warning | tee "$OUT/sdpa_triton.txt"' ;;
    long_e2e) for kernel in flash triton; do
        step "long_e2e_$kernel" 175 env LENGTHS=30 C=1 REQUESTS=3 BASELINE=0 KV_GIB=4 V2S_S=170 \
          V2S_ARGS="--long-prefill-kernel $kernel" bash benchmarks/video.sh
      done ;;
    sdpa_video) step sdpa_video 100 sh -c 'mkdir -p "$OUT" && timeout 100 python3 benchmarks/sdpa_long.py --rows 8192,7353 \
      --out "$OUT/sdpa_video.json" 2>&1 | tee "$OUT/sdpa_video.txt"' ;;
    sdpa_padded) step sdpa_padded 120 sh -c 'mkdir -p "$OUT" && timeout 120 python3 benchmarks/sdpa_long.py \
      --rows 7353,7400,7000,2048,2001 --cached 0 --pad-to 512 --out "$OUT/sdpa_padded.json" 2>&1 | grep -v Warning |
      tee "$OUT/sdpa_padded.txt" | grep -E " 0 (varlen|cudnn padded)"' ;;
    long_attention) step long_attention 60 sh -c 'mkdir -p "$OUT" && timeout 60 python3 benchmarks/prefill_attention.py \
      --long --out "$OUT/prefill_attention_long.json" 2>&1 | tee "$OUT/prefill_attention_long.log"' ;;
    *) echo "pending: no step $name (http, inproc, video_host, video, video_kv, asr, baseline, spy_asr, handoff," \
      "long_attention, long_prefill, video_flash, admission, asr_ab, sync_asr, sync_asr_before," \
      "asr_profile, admission_host, trace_asr, engine_asr, decode_attention, asr_budget, asr_burst, asr_dense, asr_2min, trace_video, video_ab," \
      "video_turns, pinned, vision_cache, talker_budget, prefill_kernels, moe_ab, video_at_once, sdpa_video, sdpa_padded, moe_sweep, moe_e2e, long_triton, long_e2e)" >&2
      exit 2 ;;
  esac
done
cp "$work/env.txt" "$OUT/env.txt"
# packed aside and moved in whole: a pack cut at the call's limit leaves no broken archive to carry
XZ_OPT="-T0 -3" timeout 60 tar cJf "$work/kernels.tar.xz" -C "$kernels" . &&
  if (($(stat -c %s "$work/kernels.tar.xz") > 16 * 1024 * 1024)); then
    echo "pending: the kernels' caches, $(du -sh "$kernels" | cut -f1), pack past 16 MiB: not brought back"
  else
    mv "$work/kernels.tar.xz" "$OUT/kernels.tar.xz"
  fi
