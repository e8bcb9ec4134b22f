#!/usr/bin/env python
"""Where an armed compiled step's cost goes (issue 48): the writer's share, the training thread's, unrecorded steps'.

One model (`bench.py --compile`'s gpt2 or mlp32) is compiled whole twice, bare and armed, and timed in blocks of K
training steps, the configurations in turn (reversed every other round):

- `every1`: armed, every step recorded;
- `nowriter`: the same, each step's record dropped as it is handed to the writer (`recorder.emit` a no-op), so the
  difference to `every1` is what the writer's work costs the run (its thread, or a writer process's CPU beside it);
- `every10`: armed, one step in ten recorded.

Printed: the machine, bare's median step, and each configuration's median ratio to bare, of wall time and of the
training thread's CPU; then the writer thread's CPU a recorded step (`every1`), as a share of the bare step: where
torch keeps every core busy, that share is paid in wall time however the writer is scheduled, so it is a floor under
the every-step ratio (issue 48's targets: GPT-2 1.08x, the MLP 1.2x). Nothing here asserts a figure; these machines
are shared, so read the ratios, not the ms.

    python bench/compile_split.py [--model gpt2] [--threads 2] [--rounds 7] [--k 20]
"""
import argparse, statistics, sys, tempfile
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / 'tests'))
import torch
import compile_bench as cb
from bench import machine_line, _writer_cpu

CONFIGS = ('bare', 'every1', 'nowriter', 'every10')

def main(model:str='gpt2', threads:int=2, rounds:int=7, k:int=20):
    from torchember import torchEmber
    print(__doc__.split('\n')[0]); print(machine_line())
    torch.set_num_threads(threads)
    m, make, blocks = cb.MODELS[model]()
    te = torchEmber(m, run='split', db=str(Path(tempfile.mkdtemp()) / 'split.db'))   # armed, then compiled
    armed = cb._stepper(cb._compile(m, 'whole', blocks), m, make)
    cb._warm(armed, 5)
    b, _, _ = cb.MODELS[model]()
    bare = cb._stepper(cb._compile(b, 'whole', blocks), b, make)
    cb._warm(bare, 5)
    emit = te.recorder.emit
    wall, cpu = {c: [] for c in CONFIGS}, {c: [] for c in CONFIGS}
    writer = []                                          # the writer thread's CPU seconds a recorded step
    for r in range(rounds):
        for c in (CONFIGS if r % 2 == 0 else CONFIGS[::-1]):
            te.capture.every = 10 if c == 'every10' else 1
            te.recorder.emit = (lambda rec: None) if c == 'nowriter' else emit
            te.flush()                                   # the last block's writes are not this one's
            w0 = _writer_cpu([te._start_writer()._t])
            w, u = cb._time(bare if c == 'bare' else armed, k)
            wall[c].append(w); cpu[c].append(u)
            if c == 'every1':
                te.flush()
                writer.append((_writer_cpu([te._start_writer()._t]) - w0) / k)
    te.recorder.emit = emit
    te.flush(); te.disarm()
    print(f"{model}, compiled whole, torch on {threads} thread(s), {rounds} rounds of {k} steps: "
          f"bare {statistics.median(wall['bare']) * 1e3:.2f} ms a step")
    for c in CONFIGS[1:]:
        ratio = lambda t: statistics.median(a / b for a, b in zip(t[c], t['bare']))
        print(f"  {c:<9} wall {ratio(wall):.3f}x  training thread's CPU {ratio(cpu):.3f}x")
    wr, b = statistics.median(writer), statistics.median(wall['bare'])
    print(f"  the writer thread's CPU a recorded step: {wr * 1e3:.2f} ms, {wr / b:.3f} of the bare step "
          f"(every step: at least {1 + wr / b:.2f}x where torch keeps every core busy)")

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', default='gpt2', choices=list(cb.MODELS))
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--rounds', type=int, default=7)
    p.add_argument('--k', type=int, default=20)
    a = p.parse_args()
    main(a.model, a.threads, a.rounds, a.k)
