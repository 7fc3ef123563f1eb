#!/usr/bin/env bash
# A venv with torch==VERSION and ckptshard (editable) for the torch-range tests.
#   scripts/torch_venv.sh VERSION FOLDER
# Torch other than the pinned one comes from the registry as a CUDA build (GBs);
# a machine-wide pip constraint capping torch (PIP_CONSTRAINT) is lifted here.
# pip's wheel cache is off: it would keep a second copy of each CUDA build on disk.
set -euo pipefail
version=$1
venv=$2
[ -f "$venv/.installed-$version" ] && exit 0
need_gib=${TORCH_VENV_NEED_GIB:-9}
parent=$(dirname "$(realpath -m "$venv")")
free_gib=$(($(df -Pk "$parent" | awk 'NR == 2 {print $4}') / 1048576))
if [ "$free_gib" -lt "$need_gib" ]; then
  echo "torch_venv.sh: torch $version needs about $need_gib GiB free for its venv; $parent has $free_gib GiB" >&2
  exit 2
fi
rm -rf "$venv"
python3 -m venv "$venv"
extra=()
case $version in 2.0.* | 2.1.* | 2.2.*) extra=("numpy<2") ;; esac # built against NumPy 1
PIP_CONSTRAINT=/dev/null "$venv/bin/pip" install -q --no-cache-dir "torch==$version" "${extra[@]}" -e '.[test]'
"$venv/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$version', torch.__version__"
touch "$venv/.installed-$version"
