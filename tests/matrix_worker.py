"""A training process for `test_guarantee_matrix.py`: arms a small MLP with the options given, trains, prints each step.

    python matrix_worker.py DB OPTIONS_JSON MODE

`MODE` is `run` (train until a signal ends it), `pause` (train `PAUSE_AFTER` steps, then sleep: killed in the pause) or
`first` (the first forward prints `inside` and sleeps in a hook of the user's: interrupted there, before any write).
Each step prints `step time` after its backward and optimizer step, so a printed step has finished by the time printed.
`OPTIONS_JSON` may hold `"compile": true`: the armed model is then compiled whole with `torch.compile` (inductor,
`fullgraph=True` but in `first` mode, whose hook of the user's breaks the graph itself), as users compile.
`TE_MATRIX_BREAK` breaks a promise on purpose, to show that the matrix sees it: `linger` makes the writer wait 5 s
before it takes a step, `closer` leaves a finished step open until the next call.
"""
import json, os, signal, sys, time

signal.signal(signal.SIGINT, signal.default_int_handler)   # as from a terminal: a background job inherits it ignored
import torch
from torch import nn
import torchember.store.writer, torchember.ember, torchember.core
from torchember import torchEmber

PAUSE_AFTER = 12

def main(db:str, options:dict, mode:str):
    broken = os.environ.get('TE_MATRIX_BREAK')
    if broken == 'linger': torchember.store.writer.LINGER_S = torchember.ember.PROCESS_LINGER_S = 5.0
    if broken == 'closer': torchember.core.Capture.close_finished = lambda self, after=None: self
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.ReLU())], nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    compiled = options.pop('compile', False)
    te = torchEmber(model, run='r', db=db, **options)
    if mode == 'first':
        def slow_once(m, args, out):
            if step == 0: print('inside', time.monotonic(), flush=True); time.sleep(30)
        model[0].register_forward_hook(slow_once)
    call = torch.compile(model, fullgraph=mode != 'first') if compiled else model   # arm, then compile
    step = 0
    while True:
        loss = call(torch.randn(16, 32)).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad()
        print(step, time.monotonic(), flush=True)   # one clock for every process of the machine
        step += 1
        if mode == 'pause' and step == PAUSE_AFTER:
            print("pause", time.monotonic(), flush=True)
            time.sleep(120)

if __name__ == '__main__': main(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])
