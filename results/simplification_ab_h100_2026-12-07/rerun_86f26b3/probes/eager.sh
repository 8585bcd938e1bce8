#!/usr/bin/env bash
set -uo pipefail
ROOT=$(pwd); W=/tmp/p; mkdir -p $W/old $W/head3
tar xzf outputs/gpu/old_434f221.tgz -C $W/old
cp -r muon_plugin $W/head3/
sed -i 's/^GRAM_RESTART_INTERVAL = 2 /GRAM_RESTART_INTERVAL = 3 /' $W/head3/muon_plugin/orthogonalize/iterations.py
nvidia-smi -L
for t in old head3 old head3; do
  echo "== $t"; (cd $W/$t && PYTHONPATH=$W/$t timeout 70 python3 $ROOT/outputs/gpu/eager_probe.py) 2>&1 | tee -a $OUT/probe_$t.txt | head -14
done
