"Ingest under load (issue 47): a writer catches up after its store stalls, rather than drop what piled up meanwhile."
import time, warnings
from torchember.store import Writer

def _stalling_store(got:list, ages:list, at:int, stall:float):
    "A store whose writes take 10 ms, and `stall` s once, the first time it is given item `at` or a later one."
    state = dict(done=False)
    def write(items):
        time.sleep(0.01)
        if not state['done'] and items[-1][0] >= at:
            state['done'] = True
            time.sleep(stall)
        now = time.monotonic()
        got.extend(i for i, _ in items); ages.extend(now - t for _, t in items)
    return write

def test_a_store_that_stalls_once_drops_nothing():
    "A write that takes 0.6 s among writes of 10 ms, a step every 4 ms: the next write takes what piled up; none dropped."
    got, ages, n = [], [], 400
    # as the writer process writes: a short linger, 16 steps a transaction
    w = Writer(_stalling_store(got, ages, at=200, stall=0.6), rows=lambda item: 130, group=16, linger=0.02)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        for i in range(n):
            w.submit((i, time.monotonic()))
            time.sleep(0.004)
        w.flush()
    w.close()
    msgs = [str(r.message) for r in rec]
    assert w.dropped == 0 and got == list(range(n)), msgs
    assert max(ages) < 1.0, f"an item waited {max(ages):.2f} s"
