"""Models by name (issue 36, item 3): a Hugging Face repo id resolved through huggingface_hub's
cache (offline here: a cache the test builds in the hub's layout), the offline miss named, and
generation_config.json read: its eos ids are stop ids, its sampling values the server's defaults
for fields a request omits."""
import json
import os

import pytest
import torch

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, pipeline
from lmdeploy_lite.api import EMBEDDED_MODEL_DIR, resolve_model_path
from lmdeploy_lite.pytorch.config import ModelConfig, sampling_defaults

COMMIT = '0123456789abcdef0123456789abcdef01234567'
GENERATION = {'eos_token_id': [2, 77], 'temperature': 0.6, 'top_p': 0.95, 'top_k': 20,
              'do_sample': True}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """`acme/tiny` at revision main in a hub cache: the embedded model's files, linked, plus a
    generation_config.json; the hub itself unreachable (offline mode)."""
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_OFFLINE', True)
    repo = tmp_path / 'models--acme--tiny'
    snapshot = repo / 'snapshots' / COMMIT
    snapshot.mkdir(parents=True)
    (repo / 'refs').mkdir()
    (repo / 'refs' / 'main').write_text(COMMIT)
    for name in os.listdir(EMBEDDED_MODEL_DIR):
        os.symlink(os.path.join(EMBEDDED_MODEL_DIR, name), snapshot / name)
    (snapshot / 'generation_config.json').write_text(json.dumps(GENERATION))
    return str(tmp_path)


def test_a_repo_id_runs_from_the_cache_under_its_name(hub_cache):
    torch.set_num_threads(1)
    path = resolve_model_path('acme/tiny', download_dir=hub_cache)
    assert path.endswith(os.path.join('snapshots', COMMIT))
    assert ModelConfig.from_pretrained(path).eos_token_ids == (0, 2, 77)   # config's + file's
    config = PytorchEngineConfig(device='cpu', session_len=64, download_dir=hub_cache)
    with pipeline('acme/tiny', config, progress=False) as pipe:
        assert pipe.model_name == 'acme/tiny' and pipe.model_path == path
        out = pipe('def f(x):', GenerationConfig(max_new_tokens=4, ignore_eos=True))
    assert out.generate_token_len == 4
    assert sampling_defaults(path) == {'temperature': 0.6, 'top_p': 0.95, 'top_k': 20}
    assert sampling_defaults(EMBEDDED_MODEL_DIR) == {}


def test_an_uncached_repo_offline_is_one_error_naming_id_and_cache(hub_cache):
    with pytest.raises(ValueError, match=rf"model_path='acme/other': not a directory, and the "
                                         rf"Hugging Face repo acme/other is not in the cache at "
                                         rf"{hub_cache}"):
        resolve_model_path('acme/other', download_dir=hub_cache)
    with pytest.raises(ValueError, match="model_path='no/such/dir': no such directory"):
        ModelConfig.from_pretrained(resolve_model_path('no/such/dir'))    # a path, not an id


def test_server_defaults_fill_only_what_a_request_omits():
    pytest.importorskip('fastapi')
    from lmdeploy_lite.serve.openai.protocol import ChatCompletionRequest
    defaults = {'temperature': 0.6, 'top_p': 0.95, 'top_k': 20}
    messages = [{'role': 'user', 'content': 'hi'}]
    omitted = ChatCompletionRequest(messages=messages).generation_config(100, 4096, defaults)
    assert (omitted.do_sample, omitted.temperature, omitted.top_p, omitted.top_k) == (
        True, 0.6, 0.95, 20)
    given = ChatCompletionRequest(messages=messages, temperature=0, top_k=5)
    config = given.generation_config(100, 4096, defaults)
    assert (config.do_sample, config.top_p, config.top_k) == (False, 0.95, 5)
    plain = ChatCompletionRequest(messages=messages).generation_config(100, 4096)
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)


def test_a_chat_template_given_as_a_file_or_text_replaces_the_models(tmp_path):
    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    (tmp_path / 'chat.jinja').write_text(template)
    messages = [{'role': 'user', 'content': 'hi'}]
    for given in (str(tmp_path / 'chat.jinja'), template):
        with pipeline(None, PytorchEngineConfig(device='cpu', session_len=64), progress=False,
                      chat_template=given) as pipe:
            assert pipe.tokenizer.decode(pipe.encode(messages)) == '[user] hi\n[assistant] '
