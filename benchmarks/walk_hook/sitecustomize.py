"""Put this folder on PYTHONPATH to walk every prefill row token by token (the A/B against
`gdn_chunk`) in a process and its children, the server's included; the step trace hook runs first
where $TRACE_HOOK names its file (only one sitecustomize is imported)."""
import os

if os.environ.get('TRACE_HOOK'):
    exec(compile(open(os.environ['TRACE_HOOK']).read(), os.environ['TRACE_HOOK'], 'exec'),
         {'__name__': 'trace_hook'})
from lmdeploy_lite.pytorch.backends.cuda import gated_delta_rule as gdr  # noqa: E402

gdr.CHUNKED_DTYPES = ()
print('walkhook: CHUNKED_DTYPES', gdr.CHUNKED_DTYPES, flush=True)
