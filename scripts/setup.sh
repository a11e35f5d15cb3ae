#!/usr/bin/env bash
# Idempotent setup of a fresh Debian 12 / Python 3.11 machine: .venv with the pinned stack, the project (editable),
# the tritonserver binary (nvidia-pytriton wheel, unless one is on PATH) and perf_analyzer (tritonclient 2.50.0 wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
PYTRITON_VERSION=0.7.0        # ships tritonserver 2.51.0 + python backend + stubs for Python 3.8-3.13
PERF_ANALYZER_WHEEL=2.50.0    # 2.52+ binaries need glibc 2.38 (Debian 12 has 2.36)

stamp="$VENV/.setup-$(cat requirements.txt scripts/setup.sh pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then echo "setup: up to date ($VENV)"; exit 0; fi

# Debian packages: libb64 for perf_analyzer; Prometheus and nginx, which the metrics and failover tests run.
missing=()
ldconfig -p | grep -q 'libb64.so.0d' || missing+=(libb64-0d)
command -v prometheus >/dev/null 2>&1 || [ -x /usr/bin/prometheus ] || missing+=(prometheus)
[ -x /usr/sbin/nginx ] || missing+=(nginx)
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
$PIP install -q -r requirements.txt
$PIP install -q --no-deps -e .

if command -v tritonserver >/dev/null 2>&1; then
  echo "setup: using tritonserver on PATH: $(command -v tritonserver)"
else
  $PIP install -q --no-deps "nvidia-pytriton==$PYTRITON_VERSION"
fi

# perf_analyzer: only the binary of the 2.50.0 wheel, behind a wrapper that sets its library path.
pa_dir="$VENV/lib/perf_analyzer"
if [ ! -x "$pa_dir/perf_analyzer" ]; then
  tmp=$(mktemp -d)
  $PIP download -q --no-deps "tritonclient==$PERF_ANALYZER_WHEEL" -d "$tmp"
  "$VENV/bin/python" - "$tmp" "$pa_dir" <<'PY'
import pathlib, sys, zipfile
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wheel = next(src.glob("tritonclient-*.whl"))
dst.mkdir(parents=True, exist_ok=True)
with zipfile.ZipFile(wheel) as zf:
    member = next(n for n in zf.namelist() if n.endswith("/bin/perf_analyzer"))
    (dst / "perf_analyzer").write_bytes(zf.read(member))
(dst / "perf_analyzer").chmod(0o755)
PY
  rm -rf "$tmp"
fi
cat > "$VENV/bin/perf_analyzer" <<'SH'
#!/usr/bin/env bash
venv="$(cd "$(dirname "$0")/.." && pwd)"
cudart="$(echo "$venv"/lib/python3*/site-packages/nvidia/cuda_runtime/lib)"
export LD_LIBRARY_PATH="$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$venv/lib/perf_analyzer/perf_analyzer" "$@"
SH
chmod +x "$VENV/bin/perf_analyzer"
"$VENV/bin/perf_analyzer" --version >/dev/null 2>&1 || "$VENV/bin/perf_analyzer" --help >/dev/null

rm -f "$VENV"/.setup-*
touch "$stamp"
echo "setup: done ($VENV)"
