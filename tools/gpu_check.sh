#!/usr/bin/env bash
# The CUDA transfer path's check on a machine with an NVIDIA GPU, in one command from the
# repository root:
#
#   1. installs the wheels carried in .whl/ (if any) into a fresh temporary directory,
#      without the network;
#   2. runs the CUDA tests: tests/test_transfer.py, tests/test_pinning.py,
#      tests/test_copy_kernel.py;
#   3. runs `tools/bench_transfer.py --device cuda --blocks 1000 --reps 5 --budget 0.5 --json`
#      twice in a row;
#   4. prints, per block size and direction, kvshm (auto) / contiguous for both runs, the
#      triton and batch columns / contiguous beside them, and whether the goal (>= 85% at
#      every size, both directions, both runs) is met.
#
# Everything goes under $OUT (default out/gpu_check): env.txt, tests.log, bench1.json,
# bench1.err, bench2.json, bench2.err, summary.txt. Every step has its own time limit
# (GPU_CHECK_TESTS_S, GPU_CHECK_BENCH_S seconds), so a hung step costs its limit and the
# next steps still run. Exit status: 0 when every step passed, else the first failure's.
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out/gpu_check}
TESTS_S=${GPU_CHECK_TESTS_S:-240}
BENCH_S=${GPU_CHECK_BENCH_S:-150}
mkdir -p "$OUT"
status=0

note() { echo "== $* ($(date +%T))"; }
keep() {  # keep the first failing step's status
    local rc=$1
    echo "rc=$rc"
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

note "install"
export PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" > /dev/null; then
    site=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl && export PYTHONPATH=$site:$PWD
    keep $?
else
    echo "no .whl/: using what is installed"
fi

note "env"
{
    nvidia-smi --query-gpu=name,driver_version,utilization.gpu,memory.used \
        --format=csv,noheader 2>&1
    uptime
    python3 -c "import sys, numpy, torch; print(sys.version.split()[0], 'torch', \
torch.__version__, 'cuda', torch.version.cuda, 'numpy', numpy.__version__)" 2>&1
    python3 -c "import triton; print('triton', triton.__version__)" 2>&1
    echo "tree $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
} | tee "$OUT/env.txt"

note "tests (limit ${TESTS_S}s)"
timeout -k 10 "$TESTS_S" python3 -m pytest -q -p no:cacheprovider tests/test_transfer.py \
    tests/test_pinning.py tests/test_copy_kernel.py 2>&1 | tee "$OUT/tests.log" | tail -n 15
keep $?

for run in 1 2; do
    note "bench run $run (limit ${BENCH_S}s)"
    timeout -k 10 "$BENCH_S" python3 tools/bench_transfer.py --device cuda --blocks 1000 \
        --reps 5 --budget 0.5 --json > "$OUT/bench$run.json" 2> "$OUT/bench$run.err"
    keep $?
    tail -n 3 "$OUT/bench$run.err"
done

note "summary"
python3 - "$OUT/bench1.json" "$OUT/bench2.json" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
import json
import sys

GOAL = 0.85
runs = []
for path in sys.argv[1:]:
    try:
        with open(path) as f:
            runs.append(json.load(f))
    except (OSError, ValueError) as e:
        print(f"{path}: no result ({e})")
        runs.append(None)
ok = all(r is not None for r in runs)
for i, r in enumerate(runs, 1):
    if r is not None:
        print(f"run {i}: {r.get('gpu')}, {r.get('seconds')} s, load {r.get('loadavg_start')} "
              f"-> {r.get('loadavg_end')}")
print("kvshm/c: kvshm (auto) / contiguous, run 1 and run 2; triton/c, batch/c: those methods")
print(f"{'dir':5} {'block':>6}  {'kvshm/c':>11}   {'triton/c':>13} {'batch/c':>13}"
      f"  {'contig GB/s':>11}")


def ratios(kind, block):
    out = []
    for r in runs:
        x = None
        for res in (r or {}).get("results", []):
            if res.get("path") == "cuda" and res.get("block_bytes") == block:
                x = res[kind]
        out.append(x)
    return out


blocks = sorted({res["block_bytes"] for r in runs if r for res in r["results"]
                 if res.get("path") == "cuda"})
for block in blocks:
    for kind in ("store", "load"):
        xs = ratios(kind, block)
        cells, side = [], {"kvshm[triton]": [], "kvshm[batch]": []}
        contig = []
        for x in xs:
            if x is None:
                cells.append("  n/a")
                ok = False
                continue
            a = x["kvshm"] / x["contiguous"]
            ok = ok and a >= GOAL
            cells.append(f"{a:5.0%}")
            contig.append(f"{x['contiguous']:.1f}")
            for k in side:
                side[k].append(f"{x[k] / x['contiguous']:.0%}" if isinstance(x.get(k), float)
                               else "-")
        tri, bat = ("/".join(side[k]) for k in side)
        print(f"{kind:5} {block >> 10:>4}Ki  {' '.join(cells)}   {tri:>13} {bat:>13}"
              f"  {'/'.join(contig):>11}")
print(f"goal: kvshm >= {GOAL:.0%} of contiguous at every size, both directions, both runs: "
      + ("MET" if ok and blocks else "NOT MET"))
EOF
keep $?
echo "gpu_check status=$status"
exit "$status"
