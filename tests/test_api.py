"""pipeline(): batch, streaming, async, prompts, errors; and the generate CLI."""
import asyncio
import os
import shutil
import subprocess
import sys

import pytest

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig, pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = PytorchEngineConfig(dtype='float32', device='cpu', block_size=8, session_len=128,
                             max_batch_size=8)
GEN = GenerationConfig(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope='module')
def model_dir(tiny_ckpt, tmp_path_factory):
    """A tiny random checkpoint plus a real BPE tokenizer with a chat template."""
    sys.path.insert(0, os.path.join(ROOT, 'tools'))
    from make_tiny_checkpoint import train_tokenizer
    path = str(tmp_path_factory.mktemp('api') / 'model')
    shutil.copytree(tiny_ckpt(True, layout='multimodal'), path)
    train_tokenizer(path, 512)
    return path


@pytest.fixture(scope='module')
def pipe(model_dir):
    with pipeline(model_dir, ENGINE, progress=False) as p:
        yield p


def test_batch_of_strings_and_token_ids(pipe):
    responses = pipe(['def main(', 'import os'], GEN)
    assert len(responses) == 2
    for r in responses:
        assert r.generate_token_len == len(r.token_ids) == 12 and r.finish_reason == 'length'
        assert r.text == pipe.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    ids = pipe.tokenizer.encode('def main(', add_special_tokens=False)
    single = pipe(ids, GEN)
    assert single.token_ids == responses[0].token_ids and single.input_token_len == len(ids)


def test_stream_infer_adds_up_to_the_batch_result(pipe):
    full = pipe(['class Foo', 'x = 1'], GEN)
    texts, ids = ['', ''], [[], []]
    for chunk in pipe.stream_infer(['class Foo', 'x = 1'], GEN):
        texts[chunk.index] += chunk.text
        ids[chunk.index] += chunk.token_ids
    assert texts == [r.text for r in full] and ids == [r.token_ids for r in full]


def test_chat_messages_go_through_the_template(pipe):
    messages = [{'role': 'user', 'content': 'hello'}]
    r = pipe(messages, GEN)
    prompt = pipe.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
    assert r.input_token_len == len(prompt)


def test_async_generate_and_cancel_frees_the_cache(pipe):
    async def run():
        chunks = [r async for r in pipe.generate('def f(', GEN)]
        gen = pipe.generate('def g(', GenerationConfig(max_new_tokens=100, ignore_eos=True))
        first = await gen.__anext__()
        await gen.aclose()                                       # client went away
        return chunks, first
    chunks, first = asyncio.run(run())
    assert chunks[-1].finish_reason == 'length'
    assert sum(len(c.token_ids) for c in chunks) == 12
    assert first.finish_reason is None
    bm = pipe.engine.scheduler.bm
    for _ in range(100):                                          # the abort lands between steps
        if bm.num_free_blocks == bm.num_usable_blocks:
            break
        import time
        time.sleep(0.05)
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_stop_words_cut_the_text(pipe):
    r = pipe('def main(', GEN)
    # a 3-character stop word from the middle of the output, not starting with whitespace
    word = next((r.text[i:i + 3] for i in range(2, len(r.text) - 2)
                 if r.text[i:i + 3].strip() == r.text[i:i + 3]), '')
    if not word:
        pytest.skip('random text has no usable stop word')
    cut = pipe('def main(', GenerationConfig(max_new_tokens=12, ignore_eos=True,
                                             stop_words=[word]))
    assert cut.finish_reason == 'stop' and word not in cut.text
    assert r.text.startswith(cut.text)


def test_bad_input_raises_before_work_and_others_continue(pipe):
    with pytest.raises(ValueError, match='prompt: empty'):
        pipe(['def ok(', ''], GEN)
    with pytest.raises(ValueError, match='session_len=128'):
        pipe(['x ' * 400], GEN)
    with pytest.raises(ValueError, match='max_new_tokens=0'):
        GenerationConfig(max_new_tokens=0)
    assert pipe('def ok(', GEN).generate_token_len == 12


def test_string_prompt_without_tokenizer_is_a_clear_error(tiny_ckpt):
    with pipeline(tiny_ckpt(False, layout='plain'), ENGINE, progress=False) as p:
        assert len(p([5, 6, 7], GEN).token_ids) == 12
        with pytest.raises(ValueError, match='has no tokenizer'):
            p('hello', GEN)


def test_speculative_pipeline_reports_acceptance(model_dir, pipe):
    plain = pipe('def main(', GEN)
    with pipeline(model_dir, ENGINE, SpeculativeConfig(num_speculative_tokens=2),
                  progress=False) as p:
        r = p('def main(', GEN)
    assert r.token_ids == plain.token_ids
    assert r.spec_stats is not None and r.spec_stats.num_drafts > 0


def test_generate_cli(model_dir):
    out = subprocess.run([sys.executable, '-m', 'lmdeploy_lite.cli.main', 'generate', model_dir,
                          '--prompt', 'def main(', '--max-new-tokens', '8', '--device', 'cpu',
                          '--speculative-num-draft-tokens', '2'],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert 'tokens/s' in out.stderr and 'mean accepted length' in out.stderr


def test_cli_bad_model_dir_is_a_clear_error(tmp_path):
    out = subprocess.run([sys.executable, '-m', 'lmdeploy_lite.cli.main', 'generate',
                          str(tmp_path / 'missing'), '--prompt', 'x'],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and 'no such directory' in out.stderr
