# bench/card.py on this 2-vCPU VM: the tree at 8ab0172 (new<N>.txt) alternating with 3f16701 (old<N>.txt, `git archive 3f16701 kvharbor bench` in .bench-old/).
for i in 1 2 3 4; do
  (cd /work/main && .venv/bin/python bench/card.py --json --ops 100000 > /tmp/ab2/new$i.txt 2>&1)
  (cd /work/main/.bench-old && PYTHONPATH=/work/main/.bench-old /work/main/.venv/bin/python bench/card.py --json --ops 100000 > /tmp/ab2/old$i.txt 2>&1)
done
{ date -u; uname -a; nproc; lscpu | grep -E 'Model name|^Flags' | cut -c1-400; free -g; df -h /tmp; } > /tmp/ab2/machine.txt 2>&1
echo finished > /tmp/ab2/done
