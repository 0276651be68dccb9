#!/usr/bin/env bash
# Downloads the wheels that bench/gpu_check.py installs on a GPU machine without network access:
# what zerotrain needs beyond the GPU image's torch, safetensors, pyyaml and transformers
# (pydantic with its dependencies, tqdm) and pytest-timeout (pyproject's pytest options use
# it), at the versions .venv has where it has them. The folder is git-ignored: carry it to the
# machine (the device tool's carry parameter: build/gpu-wheels). See bench/README.md.
#   scripts/gpu_wheels.sh [FOLDER]       PYTHON_VERSION=3.12 (the GPU image's Python)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-build/gpu-wheels}
python_version=${PYTHON_VERSION:-3.12}
py=.venv/bin/python
[ -x "$py" ] || py=python3
pinned() {  # NAME==VERSION as installed here, else NAME (the newest)
  "$py" -c 'import importlib.metadata as m, sys; print(f"{sys.argv[1]}=={m.version(sys.argv[1])}")' \
    "$1" 2>/dev/null || echo "$1"
}
mkdir -p "$dest"
rm -f "$dest"/*.whl
# pydantic-core is compiled: both architectures a GPU host may have (pip picks the one that fits)
for platform in manylinux2014_x86_64 manylinux2014_aarch64; do
  "$py" -m pip download --quiet --dest "$dest" --only-binary=:all: \
    --python-version "$python_version" --platform "$platform" "$(pinned pydantic)" "$(pinned tqdm)"
done
# pure Python; --no-deps: the image's pytest stays
"$py" -m pip download --quiet --dest "$dest" --no-deps "$(pinned pytest-timeout)"
ls "$dest"
