"""GFLOP/s of torch.mm (fp32, this process's threads) at the square 1024 shape rlkit's peak uses and at the
shapes of SmolLM2-135M's update on the fixed-length bench's batch (T=1050 tokens): forward X@W^T, and the
backward's dX = dY@W and dW = dY^T@X, per linear layer, weighted by the FLOPs each shape carries."""

import time

import torch

torch.manual_seed(0)


def rate(m, k, n, reps=None):
    a, b = torch.randn(m, k), torch.randn(k, n)
    flops = 2 * m * k * n
    reps = reps or max(3, int(2e10 / flops))
    torch.mm(a, b)
    best = 0
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        best = max(best, flops * reps / (time.perf_counter() - t))
    return best / 1e9


T, d, f, kv, V = 1050, 576, 1536, 192, 49152
print(f"threads {torch.get_num_threads()}  square 1024: {rate(1024, 1024, 1024):.0f} GFLOP/s")
layers = {"q/o": (d, d, 2), "k/v": (d, kv, 2), "gate/up": (d, f, 2), "down": (f, d, 1)}
total_f = total_t = 0
for name, (i, o, count) in layers.items():
    shapes = [(T, i, o), (T, o, i), (o, T, i)]  # forward, dX, dW
    for m, k, n in shapes:
        r = rate(m, k, n)
        fl = 2 * m * k * n * count
        total_f += fl
        total_t += fl / (r * 1e9)
        print(f"{name:8s} {m}x{k}@{k}x{n}: {r:.0f} GFLOP/s")
print(f"decoder linears, FLOP-weighted: {total_f / total_t / 1e9:.0f} GFLOP/s")
for m, k, n in [(T, d, V), (T, V, d), (V, T, d)]:
    print(f"lm head {m}x{k}@{k}x{n}: {rate(m, k, n, 3):.0f} GFLOP/s")
