"""Decode GEMMs at small M: x [M, K] @ W[N, K]^T in bf16 for the 9B shapes, M = 1..16 (a plain
step has M = batch, a k=3 verify 4 x batch). Prints microseconds and achieved GB/s (weight bytes
only: the roofline of a memory-bound decode GEMM).

    python benchmarks/bench_small_m_gemm.py
"""
import torch
import torch.nn.functional as F

SHAPES = {'gate_up': (24576, 4096), 'down': (4096, 12288), 'gdn_in': (12352, 4096),
          'o_proj': (4096, 4096), 'attn_qkv': (10240, 4096), 'lm_head_32k': (32768, 4096)}


def time_us(fn, reps=200) -> float:
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps // 20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def main():
    ms = (1, 2, 3, 4, 5, 6, 8, 16)
    print('shape        ' + ''.join(f'   M={m:<3d}' for m in ms) + '   (us; GB/s at M=1 and 4)')
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device='cuda', dtype=torch.bfloat16)
        row = []
        for m in ms:
            x = torch.randn(m, k, device='cuda', dtype=torch.bfloat16)
            row.append(time_us(lambda: F.linear(x, w)))
        gbs = [w.numel() * 2 / (t * 1e-6) / 1e9 for t in (row[0], row[3])]
        print(f'{name:12s} ' + ''.join(f'{t:8.1f}' for t in row) + f'   {gbs[0]:.0f} / {gbs[1]:.0f}')


if __name__ == '__main__':
    main()
