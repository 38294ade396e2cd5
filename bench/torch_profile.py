"""Where the GPU time of the PyTorch baseline's step goes: runs bench/torch_gpt2.py (with the flags
given) under torch.profiler, CUDA activity only, and prints per kernel its calls and GPU time per
training step (the run's total divided by its warm-up and timed steps), largest first.

    python3 bench/torch_profile.py [torch_gpt2.py flags, e.g. --compile --steps 10]
"""
import os
import runpy
import sys

from torch.profiler import ProfilerActivity, profile

BASELINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_gpt2.py")


def flag(flags, name, default):
    return int(flags[flags.index(name) + 1]) if name in flags else default


def main():
    flags = sys.argv[1:]
    steps = flag(flags, "--steps", 20) + flag(flags, "--warmup", 5)
    sys.argv = [BASELINE] + flags
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runpy.run_path(BASELINE, run_name="__main__")
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:  # older PyTorch
            device_us = event.self_cuda_time_total
        if device_us > 0:
            rows.append((device_us / steps / 1e3, event.count / steps, event.key))
    rows.sort(reverse=True)
    print(f"kernels: {sum(r[0] for r in rows):.2f} ms of GPU time per step ({steps} steps profiled)")
    for ms, calls, name in rows[:45]:
        print(f"{ms:8.3f} ms {calls:7.1f}/step  {name[:110]}")


if __name__ == "__main__":
    main()
