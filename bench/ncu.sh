# Nsight Compute on a few benchmark shapes (bench/profile.py), one device call: each kernel's duration, DRAM
# throughput, occupancy and warp state; the full reports go under $OUT. Edit the list below to choose the shapes
# and their launches (after the |, a label of kubelora.bench.variants.PATH_VARIANTS).
set -uo pipefail
mkdir -p /tmp/p/kubelora; for d in kernels engine cli bench; do cp -r "$d" /tmp/p/kubelora/; done
export PYTHONPATH=/tmp/p PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
echo "ncu: $NCU"
i=0
while IFS='|' read -r shape path; do
  i=$((i+1))
  timeout 120 "$NCU" --clock-control none --nvtx --nvtx-include "lora/" --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SourceCounters \
    python3 -P -m kubelora.bench.profile "$shape" "$path" > "$OUT/ncu_$i.txt" 2>&1
  echo "== $shape $path rc $?"
  grep -E "^  _|Duration|SM Active Cycles|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Grid Size|stalled" \
    "$OUT/ncu_$i.txt" | sed "s/  \\+/ /g" | head -60
done <<'LIST'
64 x 32 x 16|auto
256 x 32 x 8|auto
256 x 8 x 64|auto
64 x 1 x 64|auto
LIST
