#!/usr/bin/env python
"""A probe, not torchember's code (issue 48): what an unrecorded compiled step costs if the recording op is put into
dynamo's graph after tracing, with no module hooks at all, against torchember's hooks.

The GPT-2 layout of `bench.py --compile` (6 blocks, 128 wide, 64 tokens, batch 4) is compiled whole four times, each
copy with a `forward` code object of its own, and trained (forward, backward, SGD) with torch on one thread:

- `bare`: compiled as is;
- `pass_end`: a backend that finds each module call's last tensor in dynamo's graph (its `nn_module_stack`), hands
  them all to one op before the graph's output, then calls inductor;
- `pass_each`: the same, an op right after each module call's last tensor;
- `hooks`: armed with torchember (`every` too large to record), then compiled: its traced hooks and op.

The probe's op returns at once unless a flag is set (one step with it set counts the tensors it is handed), and is
registered as an ordered effect (`torch._higher_order_ops.effects`, private) so that AOTAutograd threads a token
through it rather than drop it. Printed: each copy's training step over bare's (the training thread's CPU, medians of
each round's difference, the copies in turn). It measures the cost of an op's presence only: finding the inputs of a
call, its calls and events, a block's graph shared by every block, and the backward are not done here.

    python bench/graph_pass_probe.py [--rounds 30] [--steps 4]
"""
import argparse, sys, tempfile
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / 'tests'))
sys.path.insert(0, str(HERE.parent))
import torch
from torch._inductor.compile_fx import compile_fx
import corpus
from bench import machine_line
from hook_floor import gpt_of_its_own, in_turn, over_bare

RECORD, SEEN = [False], [0]

def _define():
    "The probe's op, `emberprobe::take(Tensor[] ts) -> ()`: counts its tensors when `RECORD` is set."
    lib = torch.library.Library('emberprobe', 'DEF')
    lib.define('take(Tensor[] ts) -> ()')
    def take(ts):
        if RECORD[0]: SEEN[0] += len(ts)
    lib.impl('take', take, 'CompositeExplicitAutograd')
    torch.library.register_fake('emberprobe::take', lambda ts: None, lib=lib)
    from torch._higher_order_ops.effects import _register_effectful_op, _EffectType
    _register_effectful_op(torch.ops.emberprobe.take.default, _EffectType.ORDERED)
    return lib

_LIB = _define()

def call_ends(gm)->list:
    "The last tensor-valued node of each module call in dynamo's graph `gm`, in graph order."
    last = {}
    for n in gm.graph.nodes:
        stack = n.meta.get('nn_module_stack')
        if n.op.startswith('call_') and stack and isinstance(n.meta.get('example_value'), torch.Tensor):
            last[list(stack)[-1]] = n
    return list(dict.fromkeys(last.values()))

def pass_end(gm, example_inputs):
    "A backend: one op before the output, handed every module call's last tensor; then inductor."
    ends, out = call_ends(gm), next(n for n in gm.graph.nodes if n.op == 'output')
    with gm.graph.inserting_before(out): gm.graph.call_function(torch.ops.emberprobe.take.default, (ends,))
    gm.recompile()
    return compile_fx(gm, example_inputs)

def pass_each(gm, example_inputs):
    "A backend: an op right after each module call's last tensor; then inductor."
    for n in call_ends(gm):
        with gm.graph.inserting_after(n): gm.graph.call_function(torch.ops.emberprobe.take.default, ([n],))
    gm.recompile()
    return compile_fx(gm, example_inputs)

def copy_of(kind:str):
    "A training step of a GPT-2-layout copy compiled for `kind`, warmed up; and its torchEmber, if armed."
    model, make = gpt_of_its_own(kind)
    te = None
    if kind == 'hooks':
        from torchember import torchEmber
        te = torchEmber(model, run='probe', db=str(Path(tempfile.mkdtemp()) / 'probe.db'), every=10**9)
    backend = {'pass_end': pass_end, 'pass_each': pass_each}.get(kind, 'inductor')
    compiled, (args, kw) = torch.compile(model, backend=backend), make(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    def step():
        corpus.loss_of(compiled(*args, **kw)).backward(); opt.step(); opt.zero_grad()
    for _ in range(4): step()
    return step, te

def main(rounds:int=30, steps:int=4):
    torch.set_num_threads(1)
    print(__doc__.split('\n')[0] + ' ' + __doc__.split('\n')[1]); print(machine_line())
    made = {k: copy_of(k) for k in ['bare', 'pass_end', 'pass_each', 'hooks']}
    steps_of = {k: s for k, (s, _) in made.items()}
    RECORD[0] = True; steps_of['pass_end'](); RECORD[0] = False
    print(f"pass_end's op is handed {SEEN[0]} module calls' last tensors a step")
    times = in_turn(steps_of, rounds, steps)
    over_bare(times, steps, 'training step', 'an unrecorded step')

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--rounds', type=int, default=30)
    p.add_argument('--steps', type=int, default=4)
    a = p.parse_args()
    main(a.rounds, a.steps)
