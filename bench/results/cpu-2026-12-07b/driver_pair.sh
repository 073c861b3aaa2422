#!/bin/bash
# alternate old/new demo start-ups; print the running line
source /work/venv/bin/activate
for i in 1 2 3; do
  for t in old new; do
    d=/tmp/old_tree; [ $t = new ] && d=/work/main
    rm -rf /tmp/pair_run; ray stop --force >/dev/null 2>&1
    s=$(date +%s.%N)
    (cd $d && python -m dataflow.run graphs/ppo.py --max-steps 2 --out /tmp/pair_run 2>&1) > /tmp/pair_$t$i.txt
    e=$(date +%s.%N)
    echo "$t $i: command $(echo "$e - $s" | bc) s; $(grep -o "start-up [0-9.]* s (actor processes [0-9.]* s, node setup [0-9.]* s.*checks [0-9.]*)" /tmp/pair_$t$i.txt | sed 's/(slowest[^;]*;//')"
  done
done
