#!/usr/bin/env bash
# perf/gpu_bench.sh BUNDLE.tar.xz [RESULTS_DIR]
# On an offline GPU host that has Python and PyTorch: unpack the `make bundle` tarball, build real-size random-init
# engines on this host (ViT-B/16-224 fp16, CLIP ViT-L/14-336 bf16; PyTorch runtime on CUDA), start tritonserver
# and run the GPU scenarios (perf_analyzer sweeps with GPU utilisation, in-process baseline). Results go to
# RESULTS_DIR/<HOST>/. Re-running with the same WORK folder skips what is done.
#   PYTHON (python3)  WORK (/tmp/triton-multimodal-bench)  HOST (gpu)  MODELS ("vit clip_vision")
#   IMAGE_SETS ("mixed thumbnails")  INTERVAL_MS (1500)  TINY=1: tiny engines on CPU, to check the bundle anywhere
#   SCENARIOS ("images"; "llm": the served llm streaming run on the tiny model, bf16 on CUDA; "vlm": time to first
#   token of the served vlm for a 4K JPEG, a new file each request (no cache knows it), and for the same image asked
#   twice, LLaVA-NeXT with CLIP ViT-L/14-336 + Llama-3-8B shapes, random bf16 (first the test of a second question
#   as decode rows, on the GPU);
#   "whisper": clips/s and RTFx vs concurrency of the served whisper, large-v3 shapes, random fp16, and where
#   the engine's steps spend their time (perf.whisper_steps; WHISPER_ARGS: more perf.whisper_bench arguments, e.g.
#   "--py-spy /abs/path/py-spy": the stub's threads recorded at the highest concurrency; SAM_ARGS takes it too;
#   WHISPER_PARTS ("tests bench steps"): which of its GPU tests, perf.whisper_bench and perf.whisper_steps run);
#   "whisper_window": the batching window study (perf.batch_window) on the served whisper, large-v3 shapes;
#   "sam": the decoder's CUDA graph test, then encoder and decoder requests/s vs concurrency of the served sam,
#   ViT-H shapes, random bf16 (SAM_ARGS: more perf.sam_bench arguments, e.g. "--concurrency 16 --response-threads 4");
#   "fp8": the FP8 kernel tests, one linear layer of Llama-3-8B's shapes bf16 vs FP8 (perf.fp8_layers), and the
#   engine in bf16 vs FP8 on Llama-3-8B shapes, random weights (perf.llm_engine --dtype fp8);
#   "attention": the paged decode kernel's tests, and the engine on Llama-3-8B shapes in bf16 and FP8 with decode
#   attention by the paged kernel and by gather + SDPA, one run (perf.llm_engine --variants);
#   "gemv": the GEMV kernels' and the FP8 and paged-decode tests on the GPU, then the GEMV block configurations swept
#   on Llama-3-8B's projections in bf16 and FP8 beside cuBLAS (perf.gemv_sweep);
#   "linear": the engine on Llama-3-8B shapes in bf16 and FP8 with one-token linear layers by the GEMV kernels and by
#   cuBLAS, and weights-only FP8 by the GEMV kernels, one run (perf.llm_engine --variants);
#   "prefill": the engine's tests on the GPU, then chunked prefill and prefix caching on Llama-3-8B shapes
#   (perf.llm_prefill);
#   "lora": the LoRA tests on the GPU, then 64 streams with 1, 8 and 64 distinct rank-16 adapters against the base
#   model on Llama-3-8B shapes, and adapter load times (perf.lora_engine; LORA_ARGS: more of its arguments, e.g.
#   "--distinct 1 64");
#   "lora_kernels": the LoRA kernels per projection of Llama-3-8B at a decode step, at a few block configurations,
#   beside the every-slot product and the bytes' time (perf.lora_kernels);
#   "w8a16": the FP8 GEMM / GEMV tests on the GPU, weights-only FP8 layers at 2-256 rows beside bf16, W8A8 and
#   widened weights, block configurations swept, swapped operands too (perf.fp8_gemm_sweep; FP8_SWEEP_ARGS: more of
#   its flags, e.g. "--rows 16 32 64 128 --sweep-rows 32 64 128");
#   "fp8-engine": the FP8 GEMM and FP8 tests, then the engine on Llama-3-8B shapes in bf16, FP8 weights only (the
#   default) and FP8 with per-token activations, one run (perf.llm_engine --variants);
#   "gemv-fp8w": the GEMV configurations swept in bf16 and weights-only FP8;
#   "fp8-rows": the FP8 GEMM tests, then the engine on Llama-3-8B shapes in bf16, weights-only FP8 with the GEMM's
#   configurations as they are and swapped, and W8A8 through that GEMM on FP8 inputs (perf.llm_engine --variants);
#   "overlap": the paged decode kernel's and the overlap tests on the GPU, then
#   the engine on Llama-3-8B shapes in bf16 and weights-only FP8, each without and with overlap_steps (the
#   next step launched before this one's text is decoded), one run, and their decode steps of 1 and 64 sequences
#   under torch.profiler, kernel time by kind (perf.llm_engine --variants --profile-rows);
#   "llm8b": the served `llm` on Llama-3-8B shapes (random bf16, built here) at 1, 16 and 64 streams of 128/128
#   through perf/llm.py, beside the same engine in process on the same prompts, and the server's start-to-ready time
#   (LLM8B_FLAGS: more build_engines flags, e.g. "--overlap-steps false": on a GPU it is on unless set);
#   "speculative": the speculative decoding tests on the GPU, then perf.speculative on Llama-3-8B shapes (agreement
#   set by construction, by batch size) and, with SMOLLM2_GGUF (the GGUF file `make engines` keeps in .checkpoints/gguf/,
#   carried to the host), on SmolLM2 with prompt lookup and a draft of DRAFT_LAYERS (4) layers distilled in the run;
#   "openai" (needs a bundle made with BUNDLE_FRONTEND=1): perf.openai_bench (the OpenAI frontend against direct
#   gRPC streaming) on the tiny llm, on this host's CPU and then on the GPU (OPENAI_DEVICES, "cpu cuda"; OPENAI_ARGS:
#   more arguments, e.g. "--rounds 3 --requests-per-stream 16" for rounds long enough to settle the ratios);
#   "qos": perf.qos, QoS beside first come first served at light / 1x / 2x capacity, for each of QOS_FAMILIES
#   ("llm vlm"): llm on Llama-3-8B shapes, vlm on LLaVA-NeXT with CLIP ViT-L/14-336 + Llama-3-8B shapes (random bf16);
#   QOS_VLM_KV_MB: the vlm engines' KV cache each (24000; 12000 lets both fit an H100's 80 GB);
#   QOS_ARGS: more perf.qos arguments, e.g. "--loads 0.25 2 --duration-s 10 --variant rides=--qos-lower-rides=true");
#   "ensembles": perf.ensemble_bench for each of MODELS, one run, ViT-B/16-224 fp16 / CLIP ViT-L/14-336 bf16 as in
#   "images", ENSEMBLE_VARIANTS ("single ensemble device") side by side: single, the model alone; ensemble, CPU
#   preprocessing (ENSEMBLE_INSTANCES, 4, instances x nproc threads); device, preprocessing on the GPU
#   (DEVICE_INSTANCES, 2);
#   device-x2, that with 2 encoder instances; single-device, the model alone with preprocessing on the GPU
#   (single-device-xN: N instances of it; single-device-compile: its engine through torch.compile;
#   single-device-compile-adaptive: that batched by our batcher, which prepares the next requests while the engine
#   runs, instead of Triton's; single-device-compile-delayN: Triton's batcher waiting up to N us instead of 2000);
#   ENSEMBLE_ARGS: more arguments, e.g. "--image-sets thumbnails --concurrency 16 64
#   --label x")
set -euo pipefail
bundle="$(realpath "${1:?usage: perf/gpu_bench.sh BUNDLE.tar.xz [RESULTS_DIR]}")"
results="$(realpath -m "${2:-gpu-results}")"
PYTHON="${PYTHON:-python3}"
WORK="${WORK:-/tmp/triton-multimodal-bench}"
b="$WORK/bundle"
venv="$WORK/venv"

if [ ! -d "$b" ]; then
  echo "== unpacking $bundle"
  mkdir -p "$WORK" && tar -xJf "$bundle" -C "$WORK"
fi

if [ ! -x "$venv/bin/perf_analyzer" ]; then
  echo "== environment: a venv whose own packages (numpy<2, tritonclient) shadow the host's (torch, transformers)"
  "$PYTHON" -m venv --without-pip "$venv"
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$b"/wheels/*.whl
  "$PYTHON" -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' \
    > "$site/zz_host_packages.pth"   # .pth paths are appended after the venv's own site-packages
  echo "$b/project" > "$site/triton_multimodal.pth"
  # the host's scipy / scikit-learn are built for numpy 2: hide them here so transformers treats them as absent
  echo 'import sys; sys.modules.update(dict.fromkeys(("scipy", "sklearn"), None))' > "$site/00_hide_numpy2_builds.pth"
  cat > "$venv/bin/perf_analyzer" <<SH
#!/usr/bin/env bash
LD_LIBRARY_PATH="$b/perf_analyzer\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$b/perf_analyzer/perf_analyzer" "\$@"
SH
  chmod +x "$venv/bin/perf_analyzer"
fi
export TRITONSERVER_ROOT="$b/triton/pytriton/tritonserver" PYTHONUNBUFFERED=1
py="$venv/bin/python"
cd "$b/project"
"$py" -c 'import numpy, torch, transformers, tritonclient.grpc; print(f"numpy {numpy.__version__}, torch \
{torch.__version__} (CUDA {torch.cuda.is_available()}), transformers {transformers.__version__}")'
"$venv/bin/perf_analyzer" --version >/dev/null 2>&1 || "$venv/bin/perf_analyzer" --help >/dev/null

# Engines are built with the host's own Python: transformers' modeling code imports the host's scipy, which needs
# the host's numpy 2. Only the server's stub and the perf client run in the numpy<2 venv (EXECUTION_ENV_PATH).
# The builder still needs tritonclient (Triton's config protobuf): the bundle's wheels but numpy, on PYTHONPATH.
if [ ! -d "$WORK/buildsite/tritonclient" ]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/buildsite" \
    $(ls "$b"/wheels/*.whl | grep -v /numpy-)
fi
build=(env PYTHONPATH="$WORK/buildsite" "$PYTHON" -m build_engines --execution-env "$venv" --prepare-threads "$(nproc)")
if [[ " ${SCENARIOS:-images} " == *" images "* ]]; then
  if [ "${TINY:-0}" = 1 ]; then
    "${build[@]}" vit --tiny
    "${build[@]}" clip --tiny
  else
    "${build[@]}" vit --random-init vit-b16-224 --runtime torch --precision fp16 --device cuda
    "${build[@]}" clip --random-init clip-vit-l14-336 --runtime torch --precision bf16 --device cuda
  fi
  # shellcheck disable=SC2086
  "$py" -m perf --models ${MODELS:-vit clip_vision} --image-sets ${IMAGE_SETS:-mixed thumbnails} \
    --results "$results" --host "${HOST:-gpu}" --interval-ms "${INTERVAL_MS:-1500}" --skip-batching-study --skip-llm
fi
if [[ " ${SCENARIOS:-images} " == *" ensembles "* ]]; then
  "$py" -m pytest -q -p no:cacheprovider tests/unit/test_cuda_graphs.py tests/unit/test_device_images.py
  variants=()
  for variant in ${ENSEMBLE_VARIANTS:-single ensemble device}; do
    repo="$WORK/ensembles/$variant" flags=()
    case "$variant" in
      single-device) flags=(--preprocess-on-device true) ;;
      single-device-x*) flags=(--preprocess-on-device true --instances "${variant#single-device-x}") ;;
      single-device-compile) flags=(--preprocess-on-device true --torch-compile true) ;;
      single-device-compile-adaptive) flags=(--preprocess-on-device true --torch-compile true
                                            --batch-window adaptive) ;;
      single-device-compile-delay*) flags=(--preprocess-on-device true --torch-compile true
                                          --max-queue-delay-us "${variant#single-device-compile-delay}") ;;
      ensemble) flags=(--ensemble --preprocess-instances "${ENSEMBLE_INSTANCES:-4}") ;;
      device) flags=(--ensemble --preprocess-instances "${DEVICE_INSTANCES:-2}" --preprocess-on-device true) ;;
      device-x2) flags=(--ensemble --preprocess-instances "${DEVICE_INSTANCES:-2}" --preprocess-on-device true \
                        --instances 2) ;;
    esac
    for model in ${MODELS:-vit clip_vision}; do
      case "$model" in
        vit) "${build[@]}" vit --random-init vit-b16-224 --runtime torch --precision fp16 --device cuda \
               --repository "$repo" "${flags[@]}" ;;
        clip_vision) "${build[@]}" clip --random-init clip-vit-l14-336 --runtime torch --precision bf16 --device cuda \
               --repository "$repo" "${flags[@]}" ;;
      esac
    done
    variants+=(--variant "$variant=$repo")
  done
  # shellcheck disable=SC2086
  "$py" -m perf.ensemble_bench "${variants[@]}" --models ${MODELS:-vit clip_vision} --results "$results" \
    --host "${HOST:-gpu}" --concurrency 16 64 128 ${ENSEMBLE_ARGS:-}
fi
if [[ " ${SCENARIOS:-images} " == *" llm "* ]]; then
  "${build[@]}" llm --tiny --precision bf16 --device cuda
  "$py" -c "import sys, tempfile; from pathlib import Path; from perf.llm_scenarios import served_llm_bench; \
from perf.report import hardware_line; t = tempfile.mkdtemp(); \
served_llm_bench(Path('model_repository'), Path(sys.argv[1]) / sys.argv[2], Path(t), hardware_line('2.51.0'))" \
    "$results" "${HOST:-gpu}"
fi
if [[ " ${SCENARIOS:-images} " == *" vlm "* ]]; then
  if [ "${TINY:-0}" = 1 ]; then
    "${build[@]}" vlm --tiny
  else  # CLIP ViT-L/14-336 + Llama-3-8B shapes, random bf16 weights made on the GPU (16 GB of safetensors)
    "${build[@]}" vlm --random-init llava-next-8b --precision bf16 --device cuda
  fi
  # a cached image's second question as decode rows, image rows from the decode graphs' static buffer
  "$py" -m pytest -q -p no:cacheprovider tests/unit/test_llava_vision.py -k "same_image"
  "$py" -c "import sys; from pathlib import Path; from perf.llm_scenarios import served_vlm_bench; \
from perf.report import hardware_line; \
served_vlm_bench(Path('model_repository'), Path(sys.argv[1]) / sys.argv[2], hardware_line('2.51.0'))" \
    "$results" "${HOST:-gpu}"
fi
if [[ " ${SCENARIOS:-images} " == *" whisper "* ]]; then
  if [ "${TINY:-0}" = 1 ]; then
    "${build[@]}" whisper --tiny
  else  # Whisper large-v3 shapes (32 + 32 layers x 1280, 128 mel bins), random fp16 weights
    "${build[@]}" whisper --random-init whisper-large-v3 --precision fp16 --device cuda
  fi
  parts=" ${WHISPER_PARTS:-tests bench steps} "
  [[ "$parts" != *" tests "* ]] || "$py" -m pytest -q -p no:cacheprovider tests/unit/test_whisper.py \
    tests/unit/test_cuda_graphs.py
  [[ "$parts" != *" bench "* ]] || "$py" -m perf.whisper_bench --results "$results" --host "${HOST:-gpu}" \
    --interval-ms "${INTERVAL_MS:-3000}" ${WHISPER_ARGS:-}
  [[ "$parts" != *" steps "* || "${TINY:-0}" = 1 ]] || "$py" -m perf.whisper_steps \
    --version-dir model_repository/whisper/1 --results "$results" --host "${HOST:-gpu}"
fi
if [[ " ${SCENARIOS:-images} " == *" whisper_window "* ]]; then
  "${build[@]}" whisper --random-init whisper-large-v3 --precision fp16 --device cuda
  "$py" -m perf.batch_window --results "$results" --host "${HOST:-gpu}" --interval-ms "${INTERVAL_MS:-3000}"
fi
if [[ " ${SCENARIOS:-images} " == *" sam "* ]]; then
  if [ "${TINY:-0}" = 1 ]; then
    "${build[@]}" sam --tiny
  else  # SAM ViT-H shapes (32 layers x 1280, 256-channel neck and decoder), random bf16 weights
    "${build[@]}" sam --random-init sam-vit-h --runtime torch --precision bf16 --device cuda
    "$py" -m pytest -q -p no:cacheprovider tests/unit/test_sam.py -k "cuda_graphs or run_lengths or pack_bits"
  fi
  "$py" -m perf.sam_bench --results "$results" --host "${HOST:-gpu}" --interval-ms "${INTERVAL_MS:-3000}" ${SAM_ARGS:-}
fi
if [[ " ${SCENARIOS:-images} " == *" fp8 "* ]]; then
  "$py" -m pytest -q -p no:cacheprovider tests/unit/test_fp8.py
  "$py" -m perf.fp8_layers --results "$results" --host "${HOST:-gpu}"
  "$py" -m perf.llm_engine --random-init llama-3-8b --dtype fp8 --scenario llm-engine-fp8 --results "$results" \
    --host "${HOST:-gpu}"
fi
if [[ " ${SCENARIOS:-images} " == *" attention "* ]]; then
  "$py" -m pytest -q -p no:cacheprovider tests/unit/test_paged_decode.py
  "$py" -m perf.llm_engine --random-init llama-3-8b --variants bf16:gather,bf16:paged,fp8:gather,fp8:paged \
    --scenario llm-engine-attention --results "$results" --host "${HOST:-gpu}"
fi
if [[ " ${SCENARIOS:-images} " == *" gemv "* ]]; then
  "$py" -m pytest -q -p no:cacheprovider tests/unit/test_gemv.py tests/unit/test_fp8.py tests/unit/test_paged_decode.py \
    -k "not llm_compressor"  # (that checkpoint is made by `make fp8-reference`; it does not travel)
  "$py" -m perf.gemv_sweep --results "$results" --host "${HOST:-gpu}"
fi
if [[ " ${SCENARIOS:-images} " == *" linear "* ]]; then
  "$py" -m perf.llm_engine --random-init llama-3-8b \
    --variants bf16:paged:library,bf16:paged:gemv,fp8:paged:library,fp8:paged:gemv,fp8w:paged:gemv \
    --scenario llm-engine-gemv --results "$results" --host "${HOST:-gpu}"
fi
if [[ " ${SCENARIOS:-images} " == *" prefill "* ]]; then
  "$py" -m pytest -q -p no:cacheprovider tests/unit/test_paged_decode.py tests/unit/test_prefix_cache.py \
    tests/unit/test_llm_engine.py -k "not qwen2"
  "$py" -m perf.llm_prefill --random-init llama-3-8b --results "$results" --host "${HOST:-gpu}"
fi
if [[ " ${SCENARIOS:-images} " == *" lora_kernels "* ]]; then
  "$py" -m pytest -q -p no:cacheprovider tests/unit/test_lora.py -k "lora_kernels"  # compiled
  "$py" -m perf.lora_kernels --results "$results" --host "${HOST:-gpu}"
fi
if [[ " ${SCENARIOS:-images} " == *" lora "* ]]; then
  "$py" -m pytest -q -p no:cacheprovider tests/unit/test_lora.py
  "$py" -m perf.lora_engine --random-init llama-3-8b --results "$results" --host "${HOST:-gpu}" ${LORA_ARGS:-}
fi
if [[ " ${SCENARIOS:-images} " == *" w8a16 "* ]]; then
  "$py" -m pytest -q -p no:cacheprovider tests/unit/test_fp8_gemm.py tests/unit/test_gemv.py tests/unit/test_fp8.py \
    -k "not llm_compressor"
  "$py" -m perf.fp8_gemm_sweep --results "$results" --host "${HOST:-gpu}" ${FP8_SWEEP_ARGS:-}
fi
if [[ " ${SCENARIOS:-images} " == *" fp8-engine "* ]]; then
  "$py" -m pytest -q -p no:cacheprovider tests/unit/test_fp8_gemm.py tests/unit/test_fp8.py -k "not llm_compressor"
  "$py" -m perf.llm_engine --random-init llama-3-8b --variants bf16:paged:gemv,fp8w:paged:gemv,fp8:paged:gemv \
    --scenario llm-engine-fp8-default --results "$results" --host "${HOST:-gpu}"
fi
if [[ " ${SCENARIOS:-images} " == *" overlap "* ]]; then  # the next step launched before this one's text is decoded
  "$py" -m pytest -q -p no:cacheprovider tests/unit/test_paged_decode.py  # (the kernel combines its partitions)
  "$py" -m pytest -q -p no:cacheprovider tests/unit/test_llm_engine.py \
    -k "(overlap or graphs or ahead or drawn) and not waits"
  # what to know, not a gate for the measurement: whether launching a step ahead waits for the device anywhere
  "$py" -m pytest -q -p no:cacheprovider tests/unit/test_llm_engine.py -k "never_waits" || echo "== it waits (above)"
  "$py" -m perf.llm_engine --random-init llama-3-8b \
    --variants "${OVERLAP_VARIANTS:-bf16:paged:gemv,bf16:paged:gemv:overlap,fp8w:paged:gemv,fp8w:paged:gemv:overlap}" \
    --profile-rows 1 64 \
    --scenario llm-engine-overlap --results "$results" --host "${HOST:-gpu}"
fi
if [[ " ${SCENARIOS:-images} " == *" fp8-rows "* ]]; then  # FP8 GEMMs of 2-256 rows: swapped, FP8 inputs
  "$py" -m pytest -q -p no:cacheprovider tests/unit/test_fp8_gemm.py tests/unit/test_fp8.py -k "not llm_compressor"
  "$py" -m perf.llm_engine --random-init llama-3-8b \
    --variants bf16:paged:gemv,fp8w:paged:gemv,fp8w:paged:gemv:swap,fp8:paged:gemv:w8a8gemm+swap \
    --scenario llm-engine-fp8-rows --results "$results" --host "${HOST:-gpu}"
fi
if [[ " ${SCENARIOS:-images} " == *" gemv-fp8w "* ]]; then
  "$py" -m perf.gemv_sweep --dtypes bf16 fp8w --layers qkv_proj o_proj gate_up_proj down_proj \
    --results "$results" --host "${HOST:-gpu}"
fi
if [[ " ${SCENARIOS:-images} " == *" llm8b "* ]]; then
  if [ "${TINY:-0}" = 1 ]; then
    "${build[@]}" llm --tiny
  else
    # shellcheck disable=SC2086
    "${build[@]}" llm --random-init llama-3-8b --precision bf16 --device cuda ${LLM8B_FLAGS:-}
  fi
  "$py" -c "import sys, tempfile; from pathlib import Path; from perf.llm_scenarios import served_llm_in_process_bench; \
from perf.report import hardware_line; \
served_llm_in_process_bench(Path('model_repository'), Path(sys.argv[1]) / sys.argv[2], Path(tempfile.mkdtemp()), \
hardware_line('2.51.0'))" "$results" "${HOST:-gpu}"
fi
if [[ " ${SCENARIOS:-images} " == *" speculative "* ]]; then
  "$py" -m pytest -q -p no:cacheprovider tests/unit/test_speculative.py -k "not qwen2"
  "$py" -m perf.speculative --random-init llama-3-8b --batches 1 2 4 8 16 32 64 --results "$results" \
    --host "${HOST:-gpu}"
  if [ -n "${SMOLLM2_GGUF:-}" ]; then  # SmolLM2's GGUF file from `make engines` (.checkpoints/gguf/), carried here
    "$py" -c "import sys; from pathlib import Path; from build_engines.gguf import convert_gguf; \
convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))" "$SMOLLM2_GGUF" "$WORK/smollm2"
    "$py" -m perf.speculative --checkpoint "$WORK/smollm2" --train-draft "${DRAFT_LAYERS:-4}" \
      --results "$results" --host "${HOST:-gpu}"
  fi
fi
if [[ " ${SCENARIOS:-images} " == *" openai "* ]]; then
  for device in ${OPENAI_DEVICES:-cpu cuda}; do  # the tiny llm on this host's CPU cores, then on the GPU (bf16)
    if [ "$device" = cpu ]; then "${build[@]}" llm --tiny --device cpu
    else "${build[@]}" llm --tiny --precision bf16 --device cuda; fi
    # shellcheck disable=SC2086
    "$py" -m perf.openai_bench --results "$results" --host "${HOST:-gpu}" --label "tiny-$device" ${OPENAI_ARGS:-}
  done
fi
if [[ " ${SCENARIOS:-images} " == *" qos "* ]]; then
  if [[ " ${QOS_FAMILIES:-llm vlm} " == *" vlm "* ]]; then  # vlm decodes JPEGs with nvJPEG beside the engine's steps
    "$py" -m pytest -q -p no:cacheprovider tests/unit/test_device_images.py
  fi
  for family in ${QOS_FAMILIES:-llm vlm}; do
    # KV cache per model (three or more 8B models share the card): the llm mix needs under 300 tokens a request
    # (4 GB holds 100 such, 64 run at once), the vlm mix ~3,000 (a 4K photo's tiles): 2 x (16 + 24 GB) fit an H200,
    # an H100 with QOS_VLM_KV_MB=12000
    if [ "$family" = llm ]; then preset=llama-3-8b kv=4000; else preset=llava-next-8b kv=${QOS_VLM_KV_MB:-24000}; fi
    "${build[@]}" "$family" --random-init "$preset" --precision bf16 --device cuda
    # shellcheck disable=SC2086
    "$py" -m perf.qos --families "$family" --checkpoint "$family=.checkpoints/random-$preset" --device cuda \
      --precision bf16 --max-batch 64 --kv-cache-memory-mb "$kv" --results "$results" --host "${HOST:-gpu}" \
      ${QOS_ARGS:-}
  done
fi
echo "== results in $results/${HOST:-gpu}"
