"Arm a PyTorch model, record every module call's statistics into a SQLite event store, and read them back."
__version__ = "0.2.0"

from .stats import default_stats
from .core import record_tensor, attach
from .instruments import hist_stats
from .ember import torchEmber
from .query import runs, load, Run, summary, delete_run
from .explore import explore
from .report import report
from .diagnose import diff

__all__ = ['torchEmber', 'runs', 'load', 'Run', 'default_stats', 'record_tensor', 'attach', 'summary', 'explore', 'hist_stats', 'report', 'delete_run', 'diff']
