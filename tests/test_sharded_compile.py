"""FSDP2 per block armed first, in torchtitan's order (arm, compile each block with `fullgraph=True`, shard), and compiled
DDP in both orders (nanoGPT's: arm, compile, wrap; and arm, wrap, compile): two CPU ranks. The torchtitan order and
nanoGPT's again with `every=2, bare_unrecorded=True`: their unrecorded steps run a second, hook-free graph.

Armed before `fully_shard`, the root's forward pre-hook runs after FSDP2's, which has swapped the root's parameters for
unsharded ones whose memory it frees after the backward; torchember reads FSDP2's sharded parameter in their place
(`fsdp2_params`). Checked, eager and compiled: training equals the bare job's; no graph break added (DDP's own forward
breaks dynamo's graph where DDP is compiled, as bare; the model's graph stays one); every module's
activations on both ranks; every parameter's weight and grad rows, merged, equal the gathered tensor's stats.
"""
import math
from pathlib import Path
import pytest, torch
from torchember import load
from test_sharded import run_job, check_whole

WORKER = Path(__file__).parent/'sharded_compile_worker.py'
SETUPS = ('arm_shard', 'arm_compile_shard', 'arm_compile_ddp', 'arm_ddp_compile', 'arm_compile_shard_lean',
          'arm_compile_ddp_lean')
LEAN = ('arm_compile_shard_lean', 'arm_compile_ddp_lean')   # every=2, bare_unrecorded: steps 0 and 2 recorded
MODULES = {'', 'inp', 'norm', 'head', 'out'} | {f'blocks.{b}{c}' for b in (0, 1) for c in ('', '.fc1', '.act', '.fc2')}

@pytest.fixture(scope='module')
def job(tmp_path_factory):
    "One two-rank job over both setups: the store and each rank's results."
    pytest.importorskip('torch.distributed.fsdp')
    if not torch.distributed.is_available(): pytest.skip('torch.distributed is not available')
    tmp = tmp_path_factory.mktemp('sharded_compile')
    db = str(tmp/'store.db')
    return db, run_job(db, tmp/'result', worker=WORKER)

@pytest.mark.parametrize('setup', SETUPS)
def test_training_equals_bare_and_no_graph_break(job, setup):
    _, res = job
    for r in res:
        assert r[setup]['armed']['losses'] == r[setup]['bare']['losses']
        assert r[setup]['armed']['breaks'] == r[setup]['bare']['breaks']
        if setup != 'arm_ddp_compile': assert r[setup]['armed']['breaks'] == 0   # DDP's own forward breaks the graph
        assert r[setup]['armed']['graphs'] == r[setup]['bare']['graphs'] + (setup in LEAN)   # the hook-free one

@pytest.mark.parametrize('setup', SETUPS)
def test_every_module_on_both_ranks(job, setup):
    db, _ = job
    df = load(setup, db).df()
    for ttype in ('input', 'output'):
        got = df[df.ttype == ttype].groupby(['step', 'rank']).module.apply(set)
        assert len(got) == (4 if setup in LEAN else 6) and all(m == MODULES for m in got), (ttype, got)

@pytest.mark.parametrize('setup', SETUPS)
def test_whole_parameters_equal_the_gathered_tensors(job, setup):
    db, res = job
    check_whole(db, [{setup: r[setup]['armed']} for r in res], setup, (0, 2) if setup in LEAN else (0, 1, 2))
