"""`lmdeploy_lite serve ...` whose engine accepts drafts at synthetic rates (bench_serve.py
--synthetic-acceptance): the engine runs in a process of its own (the mp executor, as the server
runs it on CUDA), whose rejection sampler accepts draft position i at rate i (bench_pipeline.py).

    python benchmarks/serve_synthetic.py 0.8,0.6,0.5 serve api_server MODEL --device cuda \
        --speculative-num-draft-tokens 3 --engine-process ...
"""
import sys

from bench_pipeline import synthetic_acceptance_on_ranks

from lmdeploy_lite.cli.main import main

if __name__ == '__main__':
    with synthetic_acceptance_on_ranks([float(r) for r in sys.argv[1].split(',')]):
        sys.exit(main(sys.argv[2:]))
