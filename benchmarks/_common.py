"""Shared timing helpers for the benchmarks: best-of-N wall time, so that noise on a shared machine counts less.
Importing it applies `composer2.config.keep_freed_memory`, as `composer2 stage` does: the pipeline's allocator, for ours
and the peer alike (both run in this one process)."""
import time, torch
from composer2.config import keep_freed_memory
keep_freed_memory()

def best_time(fn, repeat=5, warmup=1):
    for _ in range(warmup): fn()
    best = float('inf')
    for _ in range(repeat):
        if torch.cuda.is_available(): torch.cuda.synchronize()
        t = time.perf_counter(); fn()
        if torch.cuda.is_available(): torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best

def matmul_flops(n=512, dtype=torch.float32, device='cpu'):
    "FLOP/s of a plain square torch matmul: the baseline a model's achieved FLOP/s is compared with."
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n ** 3 / best_time(lambda: a @ b, repeat=10)
