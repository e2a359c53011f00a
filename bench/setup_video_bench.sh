#!/usr/bin/env bash
# Set-up of bench/bench_video.py's anchor, torchcodec (not a dependency of the package):
# FFmpeg's shared libraries, which torchcodec loads, and torchcodec itself, with torch pinned
# by a constraints file so that pip never replaces the installed torch.
#
#   bash bench/setup_video_bench.sh            # PYTHON=.venv/bin/python by default
#
# Which torchcodec: on PyPI, 0.13.0 is the newest CPU build (its compatibility table: torch
# >= 2.11); 0.14 to 0.17 are CUDA builds that need libtorch_cuda.so and libnvrtc.so.13, so on a
# CPU-only torch they fail to import ("Could not load this library: .../libtorchcodec_image.so"),
# and their CPU builds live on download.pytorch.org/whl/cpu. With a CUDA torch the newest
# release is taken; TORCHCODEC=X.Y.Z picks another (the one torchcodec's table pairs with it).
set -euo pipefail
PYTHON=${PYTHON:-.venv/bin/python}
if ! ldconfig -p | grep -q libavcodec; then
    apt-get update -q
    apt-get install -y -q --no-install-recommends ffmpeg
fi
torch=$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')
cuda=$("$PYTHON" -c 'import torch; print(int(torch.version.cuda is not None))')
spec=torchcodec==0.13.0
[ "$cuda" = 1 ] && spec=torchcodec
[ -n "${TORCHCODEC:-}" ] && spec=torchcodec==$TORCHCODEC
constraints=$(mktemp)
echo "torch==$torch" > "$constraints"
"$PYTHON" -m pip install -q "$spec" -c "$constraints"
rm -f "$constraints"
"$PYTHON" -c 'import torch, torchcodec; print("torchcodec", torchcodec.__version__, "with torch", torch.__version__)'
