#!/usr/bin/env bash
# make bundle: one tarball for an offline GPU host that already has Python and PyTorch (perf/gpu_bench.sh runs it).
#   triton/        tritonserver 2.51 (nvidia-pytriton's build) with only the python backend and the stub for
#                  BUNDLE_PYTHON, and the libraries it links (the wheel's libpython copy left out)
#   perf_analyzer/ the binary with libb64 and libcudart.so.12
#   wheels/        what such hosts lack: numpy<2 (the 2.51 stub needs it), tritonclient and its gRPC needs, audio I/O;
#                  with BUNDLE_FRONTEND=1 also the OpenAI frontend's and its benchmark's (SCENARIOS=openai), 7 MiB that
#                  leave too little room for the working tree beside the bundle (the device takes 64 MiB in all)
#   project/       the tracked files of this working tree
# Engines are not included: their configs name host paths, and real-size weights need not travel; the host builds
# them (build_engines --random-init). Output: dist/triton-multimodal-bundle-py$BUNDLE_PYTHON.tar.xz
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${BUNDLE_PYTHON:-3.12}"
VENV="${VENV:-.venv}"
SITE="$(echo "$VENV"/lib/python3*/site-packages)"
WHEELS=(numpy==1.26.4 tritonclient==2.73.0 python-rapidjson==1.25 grpcio==1.81.1 protobuf==6.33.6
        soundfile==0.14.0 soxr==1.1.0 cffi==2.1.1 pycparser==3.12  # audio: libsndfile, soxr (not on GPU hosts)
        pycocotools==2.0.11)  # sam's masks as COCO run lengths (mask_format rle)
# the OpenAI frontend and its benchmark's client (perf.openai_bench); anyio, h11, idna, typing_extensions and uvloop
# are on such hosts already
if [ "${BUNDLE_FRONTEND:-0}" = 1 ]; then
  WHEELS+=(fastapi==0.165.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 starlette==1.10.0 pydantic==2.14.4
           pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 uvicorn==0.55.0 click==8.5.1
           httptools==0.9.0 python-multipart==0.0.34 openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2
           truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1)
fi
OUT="dist/triton-multimodal-bundle-py$PY.tar.xz"

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
root="$stage/bundle"
server="$root/triton/pytriton/tritonserver"   # the wheel's layout: the binaries' RPATHs expect it
mkdir -p "$server/bin" "$server/backends/python" "$server/python_backend_stubs/$PY" "$root/perf_analyzer" \
         "$root/wheels" "$root/project"

src="$SITE/pytriton/tritonserver"
cp "$src/bin/tritonserver" "$server/bin/"
cp "$src/backends/python/libtriton_python.so" "$src/backends/python/triton_python_backend_utils.py" \
   "$server/backends/python/"
cp "$src/python_backend_stubs/$PY/triton_python_backend_stub" "$server/python_backend_stubs/$PY/"
cp "$src/python_backend_stubs/$PY/triton_python_backend_stub" "$server/backends/python/"
mkdir -p "$root/triton/nvidia_pytriton.libs"
find "$SITE/nvidia_pytriton.libs" -maxdepth 1 -type f ! -name 'libpython3*' -exec cp {} "$root/triton/nvidia_pytriton.libs/" \;

cp "$VENV/lib/perf_analyzer/perf_analyzer" "$root/perf_analyzer/"
cp -L /usr/lib/x86_64-linux-gnu/libb64.so.0d "$root/perf_analyzer/"
cp -L "$SITE"/nvidia/cuda_runtime/lib/libcudart.so.12 "$root/perf_analyzer/"

"$VENV/bin/pip" download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$root/wheels" "${WHEELS[@]}"

# the recorded results stay out: the device copies the working tree beside the bundle, within 64 MiB in all
git ls-files -z -- . ':!perf/results' | xargs -0 tar -cf - | tar -xf - -C "$root/project"

mkdir -p dist
echo "compressing (xz) ..."
tar -C "$stage" -cf - bundle | xz -T0 -9 > "$OUT"
size=$(stat -c %s "$OUT")
tree=$(git ls-files -z | du -B1 -c --files0-from=- | tail -1 | cut -f1)  # on disk, as the device seems to count
echo "$OUT: $((size / 1048576)) MiB (+ $((tree / 1024)) KiB of tracked files beside it on the device)"
[ $((size + tree)) -lt $((63 * 1048576)) ] || { echo "bundle + working tree over 63 MiB (the device takes 64 MiB in all)"; exit 1; }
