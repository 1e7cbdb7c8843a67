#!/usr/bin/env bash
# Compiles the probe's cubins with NVRTC (no nvcc needed; KESTREL_NVRTC_LIB's library, as in
# /tmp/testenv.sh), into DIR: today's matmul module for sm_90, the probe and the wgmma matmul
# for sm_90a, the latter once per "BM_KPI_STAGES" variant given.
#   bash scripts/wgmma_probe/build.sh DIR 192_2_10 192_1_10 ...
# On the GPU machine: python3 run.py DIR 192_2_10 192_1_10 ...
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$1; shift
mkdir -p "$out"
nv="python3 scripts/wgmma_probe/nvrtc.py"
$nv "$out/matmul.cubin" sm_90 cuda/common.cuh cuda/routing.cuh cuda/matmul_common.cuh cuda/matmul.cu cuda/matmul_stream.cu cuda/moe_stream.cu cuda/matmul_tiles.cu > /dev/null
$nv "$out/probe.cubin" sm_90a cuda/common.cuh cuda/matmul_common.cuh scripts/wgmma_probe/probe.cu > /dev/null
for v in "$@"; do
  IFS=_ read -r bm kpi stages <<< "$v"
  printf '#define WG_BM %s\n#define WG_KPI %s\n#define WG_STAGES %s\n' "$bm" "$kpi" "$stages" > "$out/defines.h"
  $nv "$out/wg_$v.cubin" sm_90a "$out/defines.h" cuda/common.cuh cuda/matmul_common.cuh cuda/matmul_wgmma.cu | grep -A2 "entry function 'matmul_wgmma'" | tail -1
done
cp scripts/wgmma_probe/run.py "$out/"
