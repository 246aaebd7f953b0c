"""What a user of lmdeploy (0.10 .. 0.16) writes works here with lmdeploy's meaning: its
GenerationConfig defaults and field names, on the embedded model."""
import pytest
import torch

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, pipeline

ENGINE = PytorchEngineConfig(dtype='float32', device='cpu', session_len=64)
PROMPT = 'def add(a, b):\n'


@pytest.fixture(scope='module')
def pipe():
    torch.set_num_threads(1)
    with pipeline(backend_config=ENGINE, progress=False, num_threads=1) as p:
        yield p


def test_generation_config_defaults_are_lmdeploys():
    """lmdeploy 0.16's defaults: a sampled request without temperature or top_k samples at
    temperature 0.8 from the top 50 tokens."""
    cfg = GenerationConfig()
    assert (cfg.n, cfg.max_new_tokens, cfg.do_sample, cfg.top_p, cfg.top_k, cfg.min_p,
            cfg.temperature, cfg.repetition_penalty, cfg.ignore_eos, cfg.random_seed,
            cfg.skip_special_tokens, cfg.logprobs) == (1, 512, False, 1.0, 50, 0.0, 0.8, 1.0,
                                                       False, None, True, None)
    assert cfg.is_greedy


def test_sampling_with_the_defaults_is_temperature_0_8_and_top_k_50(pipe):
    seeded = dict(max_new_tokens=8, ignore_eos=True, do_sample=True, random_seed=5)
    default, explicit, off = [pipe(PROMPT, gen_config=GenerationConfig(**kw, **seeded))
                              for kw in ({}, dict(temperature=0.8, top_k=50),
                                         dict(temperature=1.0, top_k=0))]
    assert default.token_ids == explicit.token_ids != off.token_ids


def test_lmdeploy_values_are_accepted_with_lmdeploys_meaning(pipe):
    """top_p=0 keeps the most likely token (greedy); max_new_tokens=None generates until the
    session ends; min_new_tokens is min_tokens."""
    assert GenerationConfig(do_sample=True, top_p=0).is_greedy
    greedy = pipe(PROMPT, gen_config=GenerationConfig(max_new_tokens=8, ignore_eos=True))
    top_p_0 = pipe(PROMPT, gen_config=GenerationConfig(max_new_tokens=8, ignore_eos=True,
                                                        do_sample=True, top_p=0.0))
    assert top_p_0.token_ids == greedy.token_ids
    whole = pipe(PROMPT, gen_config=GenerationConfig(max_new_tokens=None, ignore_eos=True))
    assert whole.finish_reason == 'length'
    assert whole.input_token_len + whole.generate_token_len == ENGINE.session_len
    assert GenerationConfig(min_new_tokens=3).min_tokens == 3
    assert GenerationConfig(min_new_tokens=3, min_tokens=3).min_tokens == 3
    with pytest.raises(ValueError, match='^min_new_tokens=3: '):
        GenerationConfig(min_new_tokens=3, min_tokens=4)


def test_bad_token_ids_are_never_generated(pipe):
    """lmdeploy's bad_token_ids: banned at every step, greedy and sampled (a -inf logit_bias);
    bad_words (strings) is refused, naming bad_token_ids."""
    base = dict(max_new_tokens=8, ignore_eos=True)
    greedy = pipe(PROMPT, gen_config=GenerationConfig(**base))
    banned = sorted(set(greedy.token_ids[:3]))
    for cfg in (GenerationConfig(bad_token_ids=banned, **base),
                GenerationConfig(bad_token_ids=banned, do_sample=True, random_seed=1, **base)):
        r = pipe(PROMPT, gen_config=cfg)
        assert r.generate_token_len == 8 and not set(r.token_ids) & set(banned)
    assert GenerationConfig(bad_token_ids=7).bad_token_ids == (7,)
    with pytest.raises(ValueError, match=r"^bad_words=\['def'\]: .*bad_token_ids"):
        GenerationConfig(bad_words=['def'])
    with pytest.raises(ValueError, match='^bad_token_ids: token ids'):
        pipe(PROMPT, gen_config=GenerationConfig(bad_token_ids=[10**6]))


def test_spaces_between_special_tokens_is_accepted_and_changes_nothing(pipe):
    """lmdeploy's flag acts only with slow tokenizers; transformers 5 loads fast ones, whose
    decode never adds those spaces (nor does lmdeploy's, with them)."""
    assert pipe.tokenizer.is_fast
    eos = pipe.tokenizer.eos_token_id          # generated 3 times: special tokens side by side
    base = dict(max_new_tokens=3, ignore_eos=True, skip_special_tokens=False,
                logit_bias={eos: 100})
    on, off = [pipe(PROMPT, gen_config=GenerationConfig(spaces_between_special_tokens=flag,
                                                        **base)) for flag in (True, False)]
    assert on.text == off.text == pipe.tokenizer.eos_token * 3
    with pytest.raises(ValueError, match='^spaces_between_special_tokens='):
        GenerationConfig(spaces_between_special_tokens=1)


def test_include_stop_str_in_output_keeps_the_stop_word(pipe):
    """lmdeploy and vLLM: the text ends with the stop word instead of before it, whole and
    streamed; the stop token's id ends the output either way."""
    base = dict(max_new_tokens=12, stop_words=['('])
    cut, kept = [GenerationConfig(include_stop_str_in_output=flag, **base)
                 for flag in (False, True)]
    assert pipe(PROMPT, gen_config=cut).text + '(' == pipe(PROMPT, gen_config=kept).text
    streamed = ''.join(r.text for r in pipe.stream_infer(PROMPT, gen_config=kept))
    assert streamed.endswith('(') and streamed == pipe(PROMPT, gen_config=kept).text


def test_a_stop_token_ids_text_is_left_out_unless_asked_for(pipe):
    """lmdeploy and vLLM: the stop token's text is not in the output (its id stays in
    token_ids here, as vLLM); include_stop_str_in_output=True keeps it."""
    paren = pipe.tokenizer.encode('(', add_special_tokens=False)
    assert len(paren) == 1
    base = dict(max_new_tokens=12, stop_token_ids=paren)
    cut, kept = [GenerationConfig(include_stop_str_in_output=flag, **base)
                 for flag in (False, True)]
    r = pipe(PROMPT, gen_config=cut)
    assert r.finish_reason == 'stop' and r.token_ids[-1] == paren[0]
    assert '(' not in r.text and r.text == pipe.tokenizer.decode(r.token_ids[:-1])
    assert ''.join(c.text for c in pipe.stream_infer(PROMPT, gen_config=cut)) == r.text
    assert pipe(PROMPT, gen_config=kept).text == r.text + '('


def test_responses_read_and_add_up_as_lmdeploys(pipe):
    """lmdeploy's Response names (cached_tokens, error_message) and Response.extend, with which
    lmdeploy users join stream_infer chunks (the fields, per chunk: text, token_ids, index,
    input_token_len, generate_token_len so far, finish_reason on the last)."""
    gen = GenerationConfig(max_new_tokens=6, ignore_eos=True, logprobs=2)
    whole = pipe(PROMPT, gen_config=gen)
    joined = None
    for chunk in pipe.stream_infer([PROMPT], gen_config=gen):
        assert chunk.index == 0 and chunk.input_token_len == whole.input_token_len
        joined = joined.extend(chunk) if joined else chunk
    assert (joined.text, joined.token_ids, joined.generate_token_len, joined.finish_reason,
            joined.logprobs) == (whole.text, whole.token_ids, 6, 'length', whole.logprobs)
    assert whole.cached_tokens == whole.num_cached_tokens and whole.error_message is None


def test_engine_config_takes_lmdeploys_harmless_fields():
    """max_batch_size=None (lmdeploy's default: chosen by the engine; 64 here), thread_safe
    (every Pipeline call may come from any thread here) and quant_policy=0 (no KV-cache
    quantization); a quantized KV cache would change the output, so it is refused."""
    cfg = PytorchEngineConfig(max_batch_size=None, thread_safe=True, quant_policy=0)
    assert cfg.max_batch_size == PytorchEngineConfig().max_batch_size == 64
    with pytest.raises(ValueError, match='^quant_policy=8: '):
        PytorchEngineConfig(quant_policy=8)
    with pytest.raises(ValueError, match="^thread_safe='yes': "):
        PytorchEngineConfig(thread_safe='yes')


def test_min_new_tokens_holds_stop_words_too(pipe):
    """lmdeploy (stop words are stop ids there) and vLLM check no stop word before min tokens:
    the '(' of token 4 does not stop min_new_tokens=6, the next one (token 13) does, and the
    text keeps the first '(' and ends before the second, whole and streamed."""
    gen = GenerationConfig(max_new_tokens=16, stop_words=['('], min_new_tokens=6)
    r = pipe(PROMPT, gen_config=gen)
    assert (r.finish_reason, r.generate_token_len) == ('stop', 13)
    assert r.text == pipe.tokenizer.decode(r.token_ids).rsplit('(', 1)[0] and '(' in r.text
    assert ''.join(c.text for c in pipe.stream_infer(PROMPT, gen_config=gen)) == r.text


def test_message_content_as_a_list_of_text_parts(pipe):
    """OpenAI-style content lists, as lmdeploy takes them: text parts joined as the server joins
    them; a part that is not text is refused, naming it."""
    gen = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    parts = [{'role': 'system', 'content': [{'type': 'text', 'text': 'Be brief. '},
                                            {'type': 'text', 'text': 'Write code.'}]},
             {'role': 'user', 'content': [{'type': 'text', 'text': 'add two numbers'}]}]
    joined = [{'role': 'system', 'content': 'Be brief. Write code.'},
              {'role': 'user', 'content': 'add two numbers'}]
    assert pipe(parts, gen_config=gen).token_ids == pipe(joined, gen_config=gen).token_ids
    image = [{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': 'x'}}]}]
    with pytest.raises(ValueError, match=r"^prompt\[0\]\.content\[0\]=.*'type': 'text'"):
        pipe(image, gen_config=gen)


def test_one_generation_config_per_prompt(pipe):
    """lmdeploy's gen_config may be a list, one per prompt: each prompt runs with its own."""
    prompts = [PROMPT, 'def mul(a, b):\n']
    configs = [GenerationConfig(max_new_tokens=3, ignore_eos=True),
               GenerationConfig(max_new_tokens=5, ignore_eos=True, logprobs=2)]
    together = pipe(prompts, gen_config=configs)
    alone = [pipe(p, gen_config=c) for p, c in zip(prompts, configs)]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [len(r.token_ids) for r in together] == [3, 5]
    assert together[0].logprobs is None and len(together[1].logprobs) == 5
    streamed = {}
    for chunk in pipe.stream_infer(prompts, gen_config=configs):
        streamed.setdefault(chunk.index, []).extend(chunk.token_ids)
    assert [streamed[i] for i in range(2)] == [r.token_ids for r in alone]
    with pytest.raises(ValueError, match=r'^gen_config: a list of 1 configs for 2 prompts'):
        pipe(prompts, gen_config=configs[:1])
    with pytest.raises(ValueError, match=r'^gen_config\[1\]\.n=2: every prompt'):
        pipe(prompts, gen_config=[configs[0], GenerationConfig(n=2, max_new_tokens=2)])


def test_lmdeploys_pipeline_arguments(pipe):
    """do_preprocess=True templates a str prompt as a user message; adapter_name=None and
    use_tqdm are accepted; what would change the output is refused, naming it."""
    gen = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    templated = pipe([{'role': 'user', 'content': PROMPT}], gen_config=gen).token_ids
    assert pipe(PROMPT, gen_config=gen, do_preprocess=True).token_ids == templated
    plain = pipe(PROMPT, gen_config=gen).token_ids
    assert pipe(PROMPT, gen_config=gen, do_preprocess=False, adapter_name=None,
                use_tqdm=True).token_ids == plain
    chunks = pipe.stream_infer([PROMPT], gen_config=gen, do_preprocess=True)
    assert [t for c in chunks for t in c.token_ids] == templated
    with pytest.raises(ValueError, match=r"^adapter_name='lora1': LoRA adapters"):
        pipe(PROMPT, gen_config=gen, adapter_name='lora1')
    with pytest.raises(TypeError):
        pipe(PROMPT, gen_config=gen, adaptor_name=None)           # a typo stays visible


def test_lmdeploys_pipeline_construction_arguments():
    with pytest.raises(ValueError, match=r'^chat_template_config: '):
        pipeline(backend_config=ENGINE, chat_template_config=object())
    with pytest.raises(ValueError, match=r"^log_level='LOUD': must be one of"):
        pipeline(backend_config=ENGINE, log_level='LOUD')
    import logging
    try:
        with pipeline(backend_config=ENGINE, log_level='info', max_log_len=10,
                      trust_remote_code=True, progress=False, num_threads=1) as p:
            assert logging.getLogger('lmdeploy_lite').level == logging.INFO
            assert len(p(PROMPT, GenerationConfig(max_new_tokens=2)).token_ids) >= 1
    finally:
        logging.getLogger('lmdeploy_lite').setLevel(logging.NOTSET)
