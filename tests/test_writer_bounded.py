"A writer slower than the run keeps each transaction within `TXN_S` and holds the run back while its oldest step ages."
import threading, time, warnings
from torchember.store.writer import Writer, TXN_S

def _slow_store(per_item:float):
    "A store whose write of n items takes n * `per_item` s; what each write took and when it ended."
    writes = []
    def write(items):
        time.sleep(per_item * len(items))
        writes.append((time.monotonic(), list(items)))
    return write, writes

def test_a_slow_store_gets_short_transactions():
    write, writes = _slow_store(0.1)   # a write of 16 items would take 1.6 s, past the 1 s bound
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        w = Writer(write, group=16)
        for i in range(60):
            w.submit(i)
            time.sleep(0.01)
        w.close(timeout=30)
    sizes = [len(items) for _, items in writes]
    assert max(sizes[3:]) <= max(1, int(TXN_S / 0.1)) + 1, sizes   # once it has timed a few writes

def test_the_run_is_held_back_while_its_oldest_step_ages():
    write, writes = _slow_store(0.03)   # 3x a 10 ms step: pacing must engage during long writes
    arrived = {}
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        w = Writer(write, group=16)
        for i in range(250):
            time.sleep(0.01)
            arrived[i] = time.monotonic()
            w.submit(i)
        paced = w.paced
        w.close(timeout=30)
    assert paced > 0
    # from 2 s on: the first write takes a whole group (16 items, 0.48 s) before any write was timed, and the backlog
    # behind it drains by then; items that came at 1.5 s were written up to 1.05 s after they came (about 2 runs in 5)
    start = arrived[0] + 2.0
    late = [i for t, items in writes for i in items if arrived[i] > start and t - arrived[i] > 1.0]
    assert not late, f"{len(late)} items written over 1 s after they came: {late[:10]}"
