#!/bin/bash
# Paired timing of one kernel at two revisions (docs/journal/ quotes these as "paired runs"):
#
#   benchmarks/paired/pair.sh gemm REV_A REV_B "MR NR MC NC KC PAR PREFETCH" MxNxK...
#   benchmarks/paired/pair.sh conv REV_A REV_B "DIR PIPELINE BM BN BK WAVE SI" GxCxKxHxW...
#
# REV is a git revision, or "." for the working tree. GEMM: PAR 0 m, 1 n, 2 k; environment
# PA (pack A, default 1), ISA (1 AVX-512, default when present; 0 AVX2), BCOL=1 (B
# column-major), DTYPE (0 fp32, default; 1 bf16). conv: DIR 0 forward, 1 bwd_data, 2 bwd_weight; PIPELINE 3 gemm, 5 gvec (2 dw: bwd_weight);
# environment N, FILT (square filter, default 3), PAD, DIL, STRIDE, DI (input depth: > 1 is 3D). Both: T threads (default 2), PAIRS, and
# PARAMS_B: B's parameters when they differ from A's (two blockings of one revision), and
# FLAGS_A / FLAGS_B: compiler flags of one build only (FLAGS_A=-mno-avx512bf16: bf16 widened
# to fp32 against the vdpbf16ps kernel of the same tree).
# Builds into a temporary directory; prints one line a shape.
set -euo pipefail
mode=$1 rev_a=$2 rev_b=$3 params=$4
shift 4
here=$(cd "$(dirname "$0")" && pwd)
root=$(git -C "$here" rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tree() {  # tree REV DIR: the kernels of REV (or the working tree) under DIR
  mkdir -p "$2"
  if [ "$1" = "." ]; then cp -r "$root/kernels/cpu" "$2/"; else git -C "$root" archive "$1" kernels/cpu | tar -x -C "$2" --strip-components=1; fi
}
tree "$rev_a" "$work/a"
tree "$rev_b" "$work/b"
isa=${ISA:-$(grep -q avx512f /proc/cpuinfo && echo 1 || echo 0)}
common="-std=c++17 -O3 -march=native -fopenmp -DNDEBUG"
includes() {  # includes DIR: the kernel headers of a tree, in kernels/cpu/<family>/ or (older) flat
  echo "-I$1/cpu -I$1/cpu/gemm -I$1/cpu/grouped_conv"
}
defines() {  # defines PARAMS: the -D flags of one build
  if [ "$mode" = gemm ]; then
    read -r mr nr mc nc kc par pf <<< "$1"
    echo "-DTC_DTYPE=${DTYPE:-0} -DTC_ISA=$isa -DTC_MR=$mr -DTC_NR=$nr -DTC_MC=$mc -DTC_NC=$nc -DTC_KC=$kc -DTC_PACK_A=${PA:-1} -DTC_PAR=$par -DTC_PREFETCH=$pf"
  else
    read -r dir pipeline bm bn bk wave si <<< "$1"
    echo "-DTC_DIR=$dir -DTC_NDIM=$([ "${DI:-1}" -gt 1 ] && echo 3 || echo 2) -DTC_BM=$bm -DTC_BN=$bn -DTC_BK=$bk -DTC_PIPELINE=$pipeline -DTC_WAVE=$wave -DTC_DSB=0 -DTC_SI=$si"
  fi
}
if [ "$mode" = gemm ]; then src=$here/gemm_variant.cpp driver="-DPAIRED_GEMM"; else src=$here/conv_variant.cpp driver=""; fi
g++ $common ${FLAGS_A:-} $(defines "$params") $(includes "$work/a") -Dtc=tc_paired_a -DNAME=va -c "$src" -o "$work/a.o"
g++ $common ${FLAGS_B:-} $(defines "${PARAMS_B:-$params}") $(includes "$work/b") -Dtc=tc_paired_b -DNAME=vb -c "$src" -o "$work/b.o"
g++ $common $driver "$here/paired.cpp" "$work/a.o" "$work/b.o" -o "$work/paired"
for shape in "$@"; do
  OMP_NUM_THREADS=${T:-2} OMP_PROC_BIND=close "$work/paired" ${shape//x/ } ${PAIRS:-}
done
