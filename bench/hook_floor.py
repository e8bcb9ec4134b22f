#!/usr/bin/env python
"""What module hooks cost a compiled forward before they do anything (issue 48): the floor of recording by hooks.

The GPT-2 layout of `bench.py --compile` (6 blocks, 128 wide, 64 tokens, batch 4) is compiled whole five times, each
copy with a `forward` code object of its own (dynamo keeps compiled code per code object, so no copy can run another's
graph), and dynamo's guards on module hooks on, as arming turns them on. The copies:

- `bare`: no hooks (the baseline), and `control`: no hooks either, to show this machine's noise;
- `shared`: one no-op function as every module's forward pre-hook and forward hook;
- `partial`: a no-op `functools.partial` a hook holding an int and a tensor, as torchember's hooks hold the capture's
  key and the module's tag;
- `armed`: armed by torchember at `every=10`, so nine forwards in ten are not recorded (the cost a user pays on them).

Printed: a no-grad forward's time over `bare`'s (the training thread's CPU, medians of each round's difference, the
copies timed in turn), and beside it what dynamo's own profiler says evaluating the compiled forward's guards takes
(`torch._dynamo.guards.profile_guard_manager`, run 1,000 times as the graph is made; these guards run before every
call of it). Torch runs on one thread. Bar `armed`, nothing here records: it is the cost
of the hooks' presence alone.

    python bench/hook_floor.py [--rounds 40] [--calls 6]
"""
import argparse, statistics, sys, time, types
from functools import partial
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / 'tests'))
import torch, torch._dynamo
import corpus
from bench import machine_line

def noop(*args): return None

def gpt_of_its_own(kind:str):
    "The GPT-2 layout, `(model, make_batch)`, its `forward` a code object of its own: dynamo keeps compiled code a code object."
    model, make = corpus.gpt_like(layers=6, d=128, seq=64)
    fwd = type(model).forward
    code = fwd.__code__.replace(co_name=f'forward_{kind}')
    model.__class__ = type(f'GPT_{kind}', (type(model),), {'forward': types.FunctionType(code, fwd.__globals__)})
    return model, make

def in_turn(fns:dict, rounds:int, calls:int)->dict:
    "Name -> the training thread's CPU seconds a call of `fns[name]`, each round; the fns called in turn, reversed every other round."
    names, times = list(fns), {n: [] for n in fns}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            t = time.thread_time()
            for _ in range(calls): fns[n]()
            times[n].append((time.thread_time() - t) / calls)
    return times

def over_bare(times:dict, calls:int, call:str, what:str):
    "Print `bare`'s median time a `call`, then each copy's median difference to it, a `what`."
    print(f"{len(times['bare'])} rounds of {calls} {call}s each, torch on one thread; bare "
          f"{statistics.median(times['bare']) * 1e3:.2f} ms a {call}")
    for n in [n for n in times if n != 'bare']:
        d = statistics.median(a - b for a, b in zip(times[n], times['bare']))
        print(f"  {n:<9} {d * 1e6:+6.0f} us {what} over bare")

GUARDS = {}   # copy -> µs dynamo's profiler took to evaluate its guards

def guards_of(name:str):
    "While `name` compiles, keep what its guards take (1,000 runs); the profiler, None where torch lacks it."
    import torch._dynamo.guards as G
    profile = getattr(G, 'profile_guard_manager', None)
    if profile is None: return
    def timed(root, scope, n):
        us = profile(root, scope, 1000)
        GUARDS[name] = us
        return us
    G.profile_guard_manager = timed
    return profile

def model_of(hooks:str):
    "A GPT-2-layout model with a forward code object of its own, and `hooks` on every module; a no-grad forward of it."
    model, make = gpt_of_its_own(hooks)
    for i, m in enumerate(model.modules()):
        if hooks == 'shared': pre, post = noop, noop
        elif hooks == 'partial': pre = post = partial(noop, 10**12 + i, torch.tensor(i))
        else: continue
        m.register_forward_pre_hook(pre); m.register_forward_hook(post)
    if hooks == 'armed':
        from torchember import torchEmber
        from bench import _db
        model.te = torchEmber(model, run='hook-floor', db=_db('hook_floor'), every=10)
    compiled, (args, kw) = torch.compile(model), make(0)
    def forward():
        with torch.no_grad(): compiled(*args, **kw)
    profile = guards_of(hooks)
    try: forward()
    finally:
        if profile is not None: import torch._dynamo.guards as G; G.profile_guard_manager = profile
    for _ in range(2): forward()
    return forward

def main(rounds:int=40, calls:int=6):
    torch.set_num_threads(1)
    torch._dynamo.config.skip_nnmodule_hook_guards = False   # what arming sets
    print(__doc__.split('\n')[0]); print(machine_line())
    times = in_turn({n: model_of(n) for n in ['bare', 'control', 'shared', 'partial', 'armed']}, rounds, calls)
    over_bare(times, calls, 'no-grad forward', 'a forward')
    if GUARDS:
        print("dynamo's guards on each copy's compiled forward (its profiler, evaluated 1,000 times as it was made):")
        for n, us in GUARDS.items(): print(f"  {n:<9} {us:6.0f} us a call ({us - GUARDS['bare']:+.0f} over bare)")

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--rounds', type=int, default=40)
    p.add_argument('--calls', type=int, default=6)
    a = p.parse_args()
    main(a.rounds, a.calls)
