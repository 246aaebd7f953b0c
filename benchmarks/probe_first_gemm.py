"""Does a GEMM of a shape the process has not run before wait for the device? (cuBLAS loading
the kernel it picks.) The device is kept busy by torch.cuda._sleep, then F.linear of M rows is
timed on the host: a first M against the same M again.

    python benchmarks/probe_first_gemm.py        # CUDA only
"""
import time

import torch
import torch.nn.functional as F


def main():
    x = torch.randn(1100, 1024, device='cuda', dtype=torch.bfloat16)
    w = torch.randn(248320, 1024, device='cuda', dtype=torch.bfloat16)
    F.linear(x[:32], w)
    torch.cuda.synchronize()
    print('rows  first_or_again  host_ms (device busy ~10 ms)')
    for rows in (32, 33, 33, 57, 57, 300, 300, 1024, 1024):
        torch.cuda._sleep(20_000_000)
        start = time.perf_counter()
        F.linear(x[:rows], w)
        host_ms = 1000 * (time.perf_counter() - start)
        torch.cuda.synchronize()
        print(f'{rows:4d}  {host_ms:8.2f}')


if __name__ == '__main__':
    main()
