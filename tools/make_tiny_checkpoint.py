"""Write a tiny random-weight Qwen3.5-MoE checkpoint (with `mtp.*` tensors) and a byte-level BPE
tokenizer trained on a few standard-library files: a model to try the engine on in seconds.

    python tools/make_tiny_checkpoint.py ./tiny-model [--dense] [--vocab 512]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# `<|im_start|>role\ncontent<|im_end|>\n` per message; with tools, Qwen3.5's tool layout less its
# instructions (prompts stay short): a system turn lists them as JSON lines in <tools> (the system
# message follows), an assistant's calls are <tool_call><function=...><parameter=...> blocks, and
# 'tool' messages are <tool_response>s in a user turn. (transformers sets trim_blocks: no newline
# may follow a block tag.)
CHAT_TEMPLATE = """
{%- macro call_block(call) -%}
    {{- '<tool_call>\n<function=' ~ call.name ~ '>\n' -}}
    {%- for name, value in call.arguments.items() -%}
        {{- '<parameter=' ~ name ~ '>\n' ~ (value if value is string else value | tojson)
            ~ '\n</parameter>\n' -}}
    {%- endfor -%}
    {{- '</function>\n</tool_call>' -}}
{%- endmacro -%}
{%- if tools -%}
    {{- '<|im_start|>system\n# Tools\n\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' ~ (tool | tojson) -}}{%- endfor -%}
    {{- '\n</tools>' -}}
    {%- if messages[0].role == 'system' -%}{{- '\n\n' ~ messages[0].content -}}{%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
    {%- if m.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' ~ m.content ~ '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- elif not (tools and loop.first and m.role == 'system') -%}
        {{- '<|im_start|>' ~ m.role ~ '\n' ~ (m.content or '') -}}
        {%- for call in m.tool_calls or [] -%}
            {{- ('\n' if not loop.first else '\n\n' if m.content else '')
                ~ call_block(call.function or call) -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""
SPECIAL = ['<|endoftext|>', '<|im_start|>', '<|im_end|>']


def train_tokenizer(out_dir: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    stdlib = sysconfig.get_paths()['stdlib']
    files = [os.path.join(stdlib, n) for n in ('textwrap.py', 'string.py', 'shlex.py', 'glob.py')]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([f for f in files if os.path.isfile(f)],
              trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token='<|endoftext|>',
                                   pad_token='<|endoftext|>')
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('out_dir')
    parser.add_argument('--dense', action='store_true', help='dense MLP instead of MoE')
    parser.add_argument('--vocab', type=int, default=512)
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()
    from tests.helpers.tiny_models import make_tiny_checkpoint
    tmp = args.out_dir.rstrip('/') + '.tmp'
    path = make_tiny_checkpoint(tmp, moe=not args.dense, layout='plain', with_mtp=True,
                                seed=args.seed, vocab_size=args.vocab, eos_token_id=0)
    shutil.rmtree(args.out_dir, ignore_errors=True)
    shutil.move(path, args.out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    train_tokenizer(args.out_dir, args.vocab)
    with open(os.path.join(args.out_dir, 'config.json')) as f:
        cfg = json.load(f)
    print(f"wrote {args.out_dir}: {cfg['model_type']}, vocab {cfg['vocab_size']}, "
          f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}")


if __name__ == '__main__':
    main()
