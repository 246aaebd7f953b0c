"""Start-up of the mp executor's ranks (issue 34 session): the embedded model at dp4 ep4 with the
MTP draft (float64, CPU), three pipelines in a row in one process: seconds until the pipeline is
ready, then one request and close. Compare `LMDEPLOY_LITE_MP_START_METHOD=spawn` with the
default fork server (the first pipeline starts the server itself)."""
import sys, os
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import time, torch
torch.set_num_threads(1)
from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, pipeline
from tests.helpers import accepting
def main():
    for i in range(3):
        config = PytorchEngineConfig(dp=4, ep=4, **accepting.BASE, max_batch_size=64)
        t=time.monotonic()
        with pipeline(accepting.model_dir(), config, accepting.spec(3), progress=False) as pipe:
            t1=time.monotonic(); print('start', round(t1-t,2))
            pipe([list(p) for p in accepting.prompts()[1:2]], accepting.GREEDY)
        print('run+close', round(time.monotonic()-t1,2))
if __name__=='__main__': main()
