# Sourced (not run) by scripts/quickstart_train.sh and by CI's evaluation of the checkpoint it trains
# (tests/test_quickstart_figure.py: docs/evaluation.md's depth table), so the two pin the same kernels:
#
#   source scripts/pinned_kernels.sh
#
# One figure on every x86-64 CPU: the kernels' summation order is pinned, not chosen per CPU. At d7d7587 this
# machine (AMD EPYC, AVX-512) measured 187.60 and another 2-core machine 176.78 (issue 49): MKL, ATen and oneDNN
# each dispatch on the CPU's instruction set (and MKL on its vendor), and 300 steps of looped solves amplify a
# last-bit difference into other iteration counts. MKL's conditional numerical reproducibility in its
# COMPATIBLE branch (the only one it honours on a non-Intel CPU: AVX2 reads as AUTO there, MKL_VERBOSE shows
# it), ATen's AVX2 kernels and oneDNN at AVX2 run the same code on any CPU with AVX2. Cost: ~2.7x per MKL GEMM,
# unnoticed in this tiny model's run (5 min with the corpus build). A caller's own setting wins.
export MKL_CBWR=${MKL_CBWR:-COMPATIBLE} ATEN_CPU_CAPABILITY=${ATEN_CPU_CAPABILITY:-avx2} \
    ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-AVX2}
