#!/usr/bin/env bash
set -uo pipefail
ROOT=$(pwd); W=/tmp/p; mkdir -p $W/old $W/head3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
tar xzf outputs/gpu/old_434f221.tgz -C $W/old
cp -r muon_plugin $W/head3/
sed -i 's/^GRAM_RESTART_INTERVAL = 2 /GRAM_RESTART_INTERVAL = 3 /' $W/head3/muon_plugin/orthogonalize/iterations.py
for t in old head3 old head3; do
  if [ $t = old ]; then export MUON_PLUGIN_DISABLE_TRITON=1; else unset MUON_PLUGIN_DISABLE_TRITON; fi
  (cd $W/$t && TREE=$t PYTHONPATH=$W/$t:/tmp/site timeout 100 python3 $ROOT/outputs/gpu/cublas_probe.py) > $OUT/probe_${t}_$RANDOM.txt 2>&1
done
grep -h "^==" $OUT/probe_*.txt
