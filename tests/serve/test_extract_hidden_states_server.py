"""`serve api_server --speculative-algorithm extract_hidden_states` (issue 23): the real server
writes each request's file and returns its path on the choice (`hidden_states_path`)."""
import json
import os

import pytest

for _module in ('fastapi', 'uvicorn', 'prometheus_client'):
    pytest.importorskip(_module, reason="needs the 'serve' extra")
httpx = pytest.importorskip('httpx')

from safetensors import safe_open  # noqa: E402

from lmdeploy_lite.api import EMBEDDED_MODEL_DIR  # noqa: E402
from lmdeploy_lite.tokenizer import load_tokenizer  # noqa: E402
from tests.serve.live_server import chat, post  # noqa: E402


@pytest.mark.timeout(180)
def test_completion_with_one_token_writes_the_file_and_returns_its_path(extract_server):
    """The embedded model (8 layers), ids 0, 4 and 8: a completion with max_tokens=1 writes the
    prompt's rows (id 0 is the embedding: the checkpoint's rows of the prompt's tokens); a
    streamed chat completion's last chunk carries its file's path. The server
    (tests/serve/conftest.py) writes under its workdir's hidden/."""
    srv = extract_server
    directory = srv.workdir / 'hidden'
    assert srv.proc.args[-6:] == ['--speculative-algorithm', 'extract_hidden_states',
                                  '--speculative-aux-hidden-state-layer-ids', '0,4,8',
                                  '--hidden-states-dir', str(directory)]
    try:
        prompt = 'def main(argv):\n    return'
        r = post(srv, '/v1/completions', {'prompt': prompt, 'max_tokens': 1}, key=None).json()
        choice = r['choices'][0]
        path = choice['hidden_states_path']
        assert choice['finish_reason'] == 'length' and path == str(directory / f"{r['id']}"
                                                                   '.safetensors')
        ids = load_tokenizer(EMBEDDED_MODEL_DIR).encode(prompt, add_special_tokens=False)
        with safe_open(path, 'pt') as f:
            token_ids, hidden = f.get_tensor('token_ids'), f.get_tensor('hidden_states')
        assert token_ids.tolist() == ids and r['usage']['prompt_tokens'] == len(ids)
        assert hidden.shape == (len(ids), 3, 256) and str(hidden.dtype) == 'torch.float32'
        with safe_open(os.path.join(EMBEDDED_MODEL_DIR, 'model-00001-of-00002.safetensors'),
                       'pt') as f:
            name = 'model.language_model.embed_tokens.weight'
            embed = f.get_tensor(name) if name in f.keys() else None
        if embed is None:
            with safe_open(os.path.join(EMBEDDED_MODEL_DIR, 'model-00002-of-00002.safetensors'),
                           'pt') as f:
                embed = f.get_tensor(name)
        assert hidden[:, 0].equal(embed[token_ids].float())

        lines = []
        with httpx.stream('POST', srv.url + '/v1/chat/completions', timeout=60,
                          json={'messages': chat('hi'), 'max_tokens': 3, 'stream': True}) as resp:
            lines = [line[6:] for line in resp.iter_lines() if line.startswith('data: ')]
        assert lines[-1] == '[DONE]'
        chunks = [json.loads(x) for x in lines[:-1]]
        paths = [c['choices'][0].get('hidden_states_path') for c in chunks]
        assert all(p is None for p in paths[:-1]) and paths[-1] == str(
            directory / f"{chunks[0]['id']}.safetensors")
        assert sorted(os.listdir(directory)) == sorted(
            [f"{r['id']}.safetensors", f"{chunks[0]['id']}.safetensors"])
    finally:
        srv.stop()
