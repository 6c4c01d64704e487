#!/usr/bin/env bash
# Build llama-cpp-python (llama.cpp from source) for this CPU once, cache the wheel, install it.
#
#   tools/build_llama_cpp.sh PYTHON
#
# No prebuilt wheel of it loads on every Linux, and llama.cpp's native CPU detection can crash
# on VMs that report instructions they do not run (AMX), so the build names its instruction
# sets explicitly from /proc/cpuinfo. The wheel is cached per version and flag set under
# $SPECEDGE_WHEEL_CACHE (default ~/.cache/specedge/wheels): a second `make` installs it in
# seconds; the first build takes about 5 minutes on 2 cores.
set -euo pipefail
PY=${1:?usage: build_llama_cpp.sh PYTHON}
VERSION=0.3.36
CACHE=${SPECEDGE_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specedge/wheels}

flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
has() { [[ "$flags" == *" $1 "* ]]; }
args="-DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF"
args+=" -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx512f:AVX512 avx512vbmi:AVX512_VBMI \
            avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
    if has "${pair%%:*}"; then args+=" -DGGML_${pair#*:}=ON"; else args+=" -DGGML_${pair#*:}=OFF"; fi
done

key=$(printf '%s %s %s' "$VERSION" "$args" "$(uname -m)" | sha256sum | cut -c1-12)
dir="$CACHE/llama_cpp_python-$VERSION-$key"
wheel=$(ls "$dir"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$wheel" ]; then
    echo "building llama-cpp-python $VERSION for this CPU (about 5 minutes on 2 cores; cached in $dir)" >&2
    mkdir -p "$dir"
    tmp=$(mktemp -d "$dir/.build-XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        "$PY" -m pip wheel --quiet --no-cache-dir --no-deps --no-binary llama-cpp-python -w "$tmp" "llama-cpp-python==$VERSION"
    mv "$tmp"/llama_cpp_python-*.whl "$dir"/
    wheel=$(ls "$dir"/llama_cpp_python-"$VERSION"-*.whl | head -n1)
fi
"$PY" -m pip install --quiet "$wheel"
