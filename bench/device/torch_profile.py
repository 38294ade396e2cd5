# Per-kernel GPU time of the PyTorch peer baseline: runs shared/bench/torch_gpt2.py (same flags) under
# torch.profiler (CUDA activity only) and prints, per kernel name, the calls and the GPU time per
# training step (total over the run divided by its warm-up + timed steps), largest first.
# Usage: python3 torch_profile.py TORCH_GPT2_PY [torch_gpt2.py flags...]
import runpy, sys
import torch
from torch.profiler import profile, ProfilerActivity

script, flags = sys.argv[1], sys.argv[2:]
steps = 20
if '--steps' in flags:
    steps = int(flags[flags.index('--steps') + 1])
sys.argv = [script] + flags
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    runpy.run_path(script, run_name='__main__')
per_step = steps + 5  # torch_gpt2.py runs 5 warm-up steps before the timed ones
rows = []
for e in prof.key_averages():
    t = getattr(e, 'self_device_time_total', None)
    if t is None:
        t = e.self_cuda_time_total
    if t > 0:
        rows.append((t / per_step / 1e3, e.count / per_step, e.key))
rows.sort(reverse=True)
total = sum(r[0] for r in rows)
print(f'kernels: {total:.2f} ms of GPU time per step ({per_step} steps profiled)')
for ms, calls, name in rows[:45]:
    print(f'{ms:8.3f} ms {calls:7.1f}/step  {name[:110]}')
