#!/usr/bin/env bash
# Same-card, same-call A/B of the benchmark: 434f221 (before the simplification), HEAD, and HEAD
# with the Gram restart interval at 3 (434f221's value for m >= 256), rounds in rotated order.
set -uo pipefail
ROOT=$(pwd); : "${OUT:?}"; AB_S=${AB_S:-450}; T0=$SECONDS
W=/tmp/ab; mkdir -p $W/old $W/head3 $W/out
{ date -u; nvidia-smi -L; python3 -c 'import torch, triton, sys; print(torch.__version__, triton.__version__, sys.version.split()[0])'; } > $W/out/machine.txt 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >> $W/out/machine.txt 2>&1
export PYTHONPATH=/tmp/site
tar xzf outputs/gpu/old_434f221.tgz -C $W/old
cp -r muon_plugin scripts $W/head3/
sed -i 's/^GRAM_RESTART_INTERVAL = 2 /GRAM_RESTART_INTERVAL = 3 /' $W/head3/muon_plugin/orthogonalize/iterations.py
grep -n "^GRAM_RESTART_INTERVAL" $W/head3/muon_plugin/orthogonalize/iterations.py >> $W/out/machine.txt
declare -A DIR=([old]=$W/old [head]=$ROOT [head3]=$W/head3)
ROWS="MuonForeach (polar_express,MuonForeach (newton,MuonForeach (NorMuon,Muon (per-parameter,MuonLP (int8,MuonLP (int4,elementwise only"
ORDERS=("old head head3" "head head3 old" "head3 old head")
for r in 1 2 3; do for t in ${ORDERS[r-1]}; do
  if (( SECONDS - T0 + 75 > AB_S )); then echo "$t round $r: not started (time)" | tee -a $W/out/runs.txt; continue; fi
  s=$SECONDS
  (cd ${DIR[$t]} && XDG_CACHE_HOME=$W/xdg_$t PYTHONUNBUFFERED=1 PYTHONPATH=${DIR[$t]}:/tmp/site timeout 170 \
     python3 scripts/benchmark.py --device cuda --no-compile --sections kernels,ortho,step,memory \
     --workloads llama,gpt --rows "$ROWS" --json $W/out/${t}_$r.json) > $W/out/${t}_$r.log 2>&1
  echo "$t round $r: rc=$? $((SECONDS - s)) s (at $((SECONDS - T0)) s)" | tee -a $W/out/runs.txt
done; done
for t in old head head3; do
  (cd ${DIR[$t]} && PYTHONPATH=${DIR[$t]}:/tmp/site python3 scripts/benchmark.py --merge $W/out/${t}_*.json) > $OUT/merged_$t.txt 2>&1
done
cp $W/out/runs.txt $W/out/machine.txt $OUT/
tar czf $OUT/ab.tgz -C $W out
echo "ab done in $((SECONDS - T0)) s"
