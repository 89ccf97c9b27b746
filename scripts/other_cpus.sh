#!/usr/bin/env bash
# The numerics-sensitive tests under the kernels other CPUs would pick, reproduced on this one.
#
# PyTorch picks its vectorised kernels by ATEN_CPU_CAPABILITY (default / avx2 / avx512; random
# draws included, so the tiny model's initialisation changes too), MKL its GEMM code path by
# MKL_CBWR, oneDNN by ONEDNN_MAX_CPU_ISA. Every combination this CPU can run is tried: a level
# above the CPU's would stop on an illegal instruction. One line per combination, pass or fail;
# the exit status is non-zero if any failed.
#
#   scripts/other_cpus.sh                 # the default selection below
#   scripts/other_cpus.sh tests/test_loss.py -k reference   # any pytest arguments instead
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}

if [ $# -eq 0 ]; then
    # Weights compared across rank counts (and across a resume on another number of ranks), the
    # loss against float64, the copy guard (the tiny model's drills until copying forms), the
    # engines' log-probs against the trainer's (in process, and between the run's actors).
    set -- tests/test_loss.py \
        "tests/test_trainer_ranks.py::test_two_ranks_equal_one_rank_on_the_whole_batch" \
        "tests/test_trainer_ranks.py::test_a_zero3_checkpoint_resumes_on_another_number_of_ranks_with_its_optimizer_state" \
        "tests/test_tiny_model.py::test_the_default_base_model_forms_copying_within_its_drill_budget" \
        tests/test_weight_sync.py \
        "tests/test_actor_faults.py::test_every_engine_actor_follows_the_trainer_rank_over_either_backend"
fi

flags=$(grep -m1 '^flags' /proc/cpuinfo)
aten=(avx2 default) mkl=(AVX2 COMPATIBLE) onednn=(AVX2 SSE41)
if [[ $flags == *avx512f* ]]; then
    aten=(avx512 "${aten[@]}") mkl=(AVX512 "${mkl[@]}") onednn=(AVX512_CORE "${onednn[@]}")
fi
if [[ $flags != *avx2* ]]; then
    echo "this CPU has no AVX2: only the default kernels can run" >&2
    aten=(default) mkl=(COMPATIBLE) onednn=(SSE41)
fi

logs=outputs/other-cpus
mkdir -p "$logs"
failed=0
for a in "${aten[@]}"; do
    for m in "${mkl[@]}"; do
        for o in "${onednn[@]}"; do
            name="ATEN_CPU_CAPABILITY=$a MKL_CBWR=$m ONEDNN_MAX_CPU_ISA=$o"
            log="$logs/$a-$m-$o.log"
            start=$SECONDS
            # Compile caches of its own: with shared ones, kernels Inductor generated under avx2
            # were reused under default, whose build lacks AVX2's headers, and failed to compile.
            cache="$logs/cache/$a-$m-$o"
            if ATEN_CPU_CAPABILITY=$a MKL_CBWR=$m ONEDNN_MAX_CPU_ISA=$o OMP_NUM_THREADS=1 \
                TORCHINDUCTOR_CACHE_DIR="$cache/inductor" VLLM_CACHE_ROOT="$cache/vllm" \
                "$PYTHON" -m pytest -q -p no:cacheprovider -s -m "soak or not soak" "$@" >"$log" 2>&1; then
                verdict=pass
            else
                verdict=FAIL failed=1
            fi
            echo "$name: $verdict ($(tail -n1 "$log" | tr -d '='), $((SECONDS - start)) s; $log)"
        done
    done
done
exit $failed
