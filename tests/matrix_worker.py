"""A training process for `test_guarantee_matrix.py`: arms a small MLP with the options given, trains, prints each step.

    python matrix_worker.py DB OPTIONS_JSON MODE

`MODE` is `run` (train until a signal ends it), `pause` (train `PAUSE_AFTER` steps, then sleep: killed in the pause) or
`first` (the first forward prints `inside` and sleeps in a hook of the user's: interrupted there, before any write).
Each step prints `step time` after its backward and optimizer step, so a printed step has finished by the time printed.
`OPTIONS_JSON` may hold `"compile": true`: the armed model is then compiled whole with `torch.compile` (inductor,
`fullgraph=True` but in `first` mode, whose hook of the user's breaks the graph itself), as users compile.
`OPTIONS_JSON` may hold `"slow_write": k`: each step written then costs the writer `k` times what a step costs the run
(its time bar what it waited for the writer), a store slower than the run whatever the machine's load, and with
`"slow_max": s` at most `s` a step: the writer thread sleeps before each write what its writes do not already take of
that (then writes itself, or through the writer process), and prints `wrote began ended steps...` after each write
(and `submitted time step` as each step is handed to the writer). After each step the writer's `paced` (the seconds
the run has waited for it) is printed as `paced s`,
and each step the writer drops, thinning what waits (it falls behind by more than holding the run back makes up), as
`dropped step`. `"step_s": s` has each step spend `s` more outside torch (loading data, say).
`TE_MATRIX_BREAK` breaks a promise on purpose, to show that the matrix sees it: `linger` makes the writer wait 5 s
before it takes a step, `closer` leaves a finished step open until the next call.
On SIGTERM or SIGINT, torchember's handler prints on stderr as it is entered (`signal N entered ...`: whether a step
was changing hands, so that it defers the signal), where it found the main thread and the open step's state
(`signal at ...`), how long it waited for the writer (`signal waited ...`), and whether it raised or returned: a lost
step's message shows these lines.
"""
import json, os, signal, sys, time

signal.signal(signal.SIGINT, signal.default_int_handler)   # as from a terminal: a background job inherits it ignored
import torch
from torch import nn
import torchember.store.writer, torchember.ember, torchember.core
from torchember import torchEmber
import corpus

PAUSE_AFTER = 12

def say(*parts):
    "Print `parts` as one line in one write: the writer thread prints too, and `print` writes its parts one by one."
    sys.stdout.write(' '.join(map(str, parts)) + '\n')
    sys.stdout.flush()

def trace_signals():
    "Have torchember's signal handler print, on stderr, where it found the main thread and what it waited for."
    import torchember.ember as E
    inner = E._write_finished
    def traced(ends:bool):
        sys.stderr.write(f"signal: writing the finished steps (ends {ends})\n")
        try:
            f, where = sys._getframe(3), []   # the frame the signal interrupted (below the handler and `entered`)
            while f is not None and len(where) < 8: where.append(f.f_code.co_name); f = f.f_back
            for te in list(E._armed.values()):
                c, w = te.capture, te.writer
                sys.stderr.write(f"signal at {time.monotonic()} in {'<'.join(where)}: step {c.step} open {c._open} "
                                 f"depth {c._depth} grads {c._grads is not None} due {c._backward_due} "
                                 f"finished {c._done_at} waiting {w.waiting() if w else None}\n")
        except Exception as e: sys.stderr.write(f"signal: its state unread ({type(e).__name__}: {e})\n")
        t = time.monotonic()
        try: return inner(ends)
        except BaseException as e:
            sys.stderr.write(f"signal handler raised {type(e).__name__}: {e}\n")
            raise
        finally:
            ws = [te.writer for te in list(E._embers) if te.writer is not None]
            sys.stderr.write(f"signal waited {time.monotonic() - t:.3f} s, still waiting {[w.waiting() for w in ws]}\n")
    E._write_finished = traced
    handler = E._on_signal
    def entered(signum, frame):
        sys.stderr.write(f"signal {signum} entered at {time.monotonic()}, deferred {E._deferred.get(signum, 0)}, "
                         f"changing step {E._changing_step(frame)}\n")
        try: return handler(signum, frame)
        except BaseException as e:
            sys.stderr.write(f"signal handler raised {type(e).__name__}: {e}\n")
            raise
        finally: sys.stderr.write(f"signal handler returned at {time.monotonic()}\n")
    E._on_signal = entered   # the handler arming installs

def main(db:str, options:dict, mode:str):
    trace_signals()
    broken = os.environ.get('TE_MATRIX_BREAK')
    if broken == 'linger': torchember.store.writer.LINGER_S = torchember.ember.PROCESS_LINGER_S = 5.0
    if broken == 'closer': torchember.core.Capture.close_finished = lambda self, after=None: self
    torch.manual_seed(0)
    body = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.ReLU())], nn.Linear(32, 1))
    model = corpus.Wrapped(body) if options.pop('wrapped', False) else body
    if options.pop('regions', False): model = corpus.regioned(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    compiled = options.pop('compile', False)
    if options.pop('compiled_autograd', False):   # every backward compiled, for the process's life
        torch._dynamo.compiled_autograd._enable(torch.compile()).__enter__()
    # s a step costs the run, bar its waits for the writer; and the writer, bar its sleep
    slow, work, wrote, step_s = options.pop('slow_write', 0), [0.01], [0.], options.pop('step_s', 0)
    slow_max = options.pop('slow_max', float('inf'))
    if slow:
        class SlowWriter(torchember.ember.Writer):
            def __init__(self, write, *args, **kwargs):
                def slow_write(steps):
                    t0 = time.monotonic()
                    time.sleep(max(min(slow * work[0], slow_max) - wrote[0], 0) * len(steps))
                    t = time.monotonic()
                    try: return write(steps)
                    finally:
                        wrote[0] = 0.8 * wrote[0] + 0.2 * (time.monotonic() - t) / len(steps)
                        say('wrote', t0, time.monotonic(), *(s['step'] for s in steps))
                super().__init__(slow_write, *args, **kwargs)
            def submit(self, item):
                say('submitted', time.monotonic(), item.step)
                return super().submit(item)
            def _thin(self, *args, **kwargs):
                before = [e[1] for e in self.pending]
                try: return super()._thin(*args, **kwargs)
                finally:
                    left = {id(e[1]) for e in self.pending}
                    for rec in before:
                        if id(rec) not in left: say('dropped', rec.step)
        torchember.ember.Writer = SlowWriter   # the writer a torchEmber starts
    paced = lambda: te.writer.paced if te.writer is not None else 0.
    te = torchEmber(model, run='r', db=db, **options)
    if mode == 'first':
        def slow_once(m, args, out):
            if step == 0: say('inside', time.monotonic()); time.sleep(30)
        body[0].register_forward_hook(slow_once)
    call = torch.compile(model, fullgraph=mode != 'first') if compiled else model   # arm, then compile
    step = 0
    while True:
        t, waited = time.monotonic(), paced()
        loss = call(torch.randn(16, 32)).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad()
        say(step, time.monotonic())   # one clock for every process of the machine
        if step_s: time.sleep(step_s)
        if slow:
            work[0] = 0.8 * work[0] + 0.2 * (time.monotonic() - t - (paced() - waited))
            say('paced', paced())
        step += 1
        if mode == 'pause' and step == PAUSE_AFTER:
            say("pause", time.monotonic())
            time.sleep(120)

if __name__ == '__main__': main(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])
