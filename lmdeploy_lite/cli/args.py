"""The engine's side of the command line: the flags every command shares (engine, sampling,
speculation, executor) and the configs built from them."""
from __future__ import annotations

import argparse
import dataclasses
import os

from lmdeploy_lite.messages import (DEVICES, DTYPES, EXECUTOR_BACKENDS, LOAD_FORMATS,
                                    SPEC_METHODS, SSM_STATE_DTYPES, PytorchEngineConfig,
                                    SpeculativeConfig)

LOG_LEVELS = ('CRITICAL', 'ERROR', 'WARNING', 'INFO', 'DEBUG')


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default, unless its help says it already or there is none."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or 'default' in (action.help or ''):
            return action.help
        return super()._get_help_string(action)


def engine_args(p: argparse.ArgumentParser):
    p.add_argument('model', nargs='?', default=None,
                   help='HF model directory or Hugging Face repo id (default: the embedded model)')
    p.add_argument('--revision', help='a repo id: the branch, tag or commit')
    p.add_argument('--backend', default='pytorch', choices=['pytorch'],
                   help="lmdeploy's engine choice: this is its PyTorch engine")
    p.add_argument('--trust-remote-code', action='store_true',
                   help='accepted as in lmdeploy; no code is loaded from a checkpoint here')
    p.add_argument('--quant-policy', type=int, default=0, choices=[0],
                   help="lmdeploy's KV-cache quantization: 0 (none) is the only one here")
    p.add_argument('--tp', '--tensor-parallel-size', type=int, default=1,
                   help='tensor-parallel ranks per DP group')
    p.add_argument('--dp', '--data-parallel-size', type=int, default=1,
                   help='data-parallel ranks (one process each)')
    p.add_argument('--ep', type=int, default=1, help='expert-parallel ranks (MoE models)')
    p.add_argument('--chat-template', metavar='FILE_OR_TEMPLATE',
                   help="a Jinja chat template (a file, or the template itself) instead of the "
                        "model's")
    p.add_argument('--download-dir', help="a repo id: the hub cache (default: huggingface_hub's)")
    p.add_argument('--dtype', default='auto', choices=DTYPES,
                   help='weights/activations dtype (auto: float32 on CPU, the checkpoint dtype '
                        'on CUDA)')
    p.add_argument('--device', default='auto', choices=DEVICES,
                   help='where to run (auto: CUDA when present)')
    p.add_argument('--max-batch-size', type=int, default=64, help='sequences per step')
    p.add_argument('--session-len', '--max-model-len', type=int, default=None,
                   help='max tokens per sequence, prompt included (default: the model maximum)')
    p.add_argument('--cache-max-entry-count', type=float, default=0.8,
                   help='fraction of free memory for the KV cache')
    p.add_argument('--cache-block-seq-len', '--block-size', dest='block_size', type=int,
                   default=64, help='tokens per KV-cache block')
    p.add_argument('--speculative-algorithm', default=None, choices=SPEC_METHODS,
                   help='speculative decoding method (default qwen3_5_mtp when a draft count '
                        'is given); extract_hidden_states decodes plainly and writes each '
                        "request's hidden states at --speculative-aux-hidden-state-layer-ids to "
                        '--hidden-states-dir')
    p.add_argument('--speculative-num-draft-tokens', type=int, default=None,
                   help='drafts per step, 1..8 (enables speculative decoding)')
    p.add_argument('--speculative-draft-model', default=None,
                   help='directory with the mtp.* tensors (default: the target model)')
    p.add_argument('--speculative-tp', type=int, default=None,
                   help="the MTP draft's tp: a divisor of --tp (default: the target's tp)")
    p.add_argument('--speculative-ep', type=int, default=None,
                   help="the MTP draft's ep: 1 (experts on every rank) or --ep (the default)")
    p.add_argument('--speculative-token-map', default=None, metavar='PATH',
                   help="token ids the MTP draft may propose: a JSON list or a safetensors file "
                        "with an int64 tensor 'token_map', most frequent first (build one with "
                        "tools/build_token_map.py); output is unchanged, drafting is cheaper")
    p.add_argument('--speculative-aux-hidden-state-layer-ids', default=None, metavar='IDS',
                   help='extract_hidden_states: comma-separated layer ids, e.g. 2,18,34 (id i is '
                        "transformers' output_hidden_states[i]: 0 the embedding output, "
                        'num_hidden_layers the final-normed hidden state)')
    p.add_argument('--hidden-states-dir', default=None, metavar='DIR',
                   help='extract_hidden_states: where each finished request\'s '
                        '<request id>.safetensors goes (created if missing)')
    p.add_argument('--speculative-dynamic', action=argparse.BooleanOptionalAction, default=True,
                   help='pick each step\'s draft count (0 .. --speculative-num-draft-tokens) '
                        'from the batch size and the measured acceptance; '
                        '--no-speculative-dynamic: always draft the full count (benchmarks)')
    p.add_argument('--distributed-executor-backend', default='mp', choices=EXECUTOR_BACKENDS,
                   help='how tp * dp > 1 ranks run: mp (processes on this host) or ray (one '
                        'actor per rank across a ray cluster)')
    p.add_argument('--ray-address', default=None,
                   help="ray cluster to join with the ray backend, e.g. 'auto' or HEAD:6379 "
                        '(sets RAY_ADDRESS; default: RAY_ADDRESS, else a local cluster)')
    p.add_argument('--async-scheduling', action=argparse.BooleanOptionalAction, default=None,
                   help='prepare the next decode step while the device runs the current one '
                        '(default: on with CUDA, off on CPU)')
    p.add_argument('--eager-mode', action='store_true', help='no CUDA graphs at all')
    p.add_argument('--max-prefill-graph-tokens', type=int, default=4096,
                   help='prefill and mixed steps of up to this many tokens replay CUDA graphs '
                        '(0: eagerly)')
    p.add_argument('--load-format', default='auto', choices=LOAD_FORMATS,
                   help="'dummy': random weights of the checkpoint's shapes (config.json only; "
                        "benchmarks)")
    p.add_argument('--model-format', default=None, choices=['fp8'],
                   help="fp8: quantize a bf16 checkpoint's linear weights block-wise at load "
                        "(an FP8 checkpoint is read as FP8 without it)")
    p.add_argument('--ssm-state-dtype', default='auto', choices=SSM_STATE_DTYPES,
                   help="storage dtype of the linear-attention recurrent state (auto: the "
                        "checkpoint's mamba_ssm_dtype, float32 for Qwen3.5; bfloat16 halves "
                        "the state memory at some cost in exactness)")
    p.add_argument('--enable-prefix-caching', action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks and linear-attention states of earlier requests' "
                        'prompt prefixes (a hit never changes a token); '
                        '--no-enable-prefix-caching: prefill every prompt whole')
    p.add_argument('--sequence-parallel', action='store_true',
                   help='sequence parallelism inside each TP group: between the TP linear '
                        'layers each rank keeps 1/tp of the tokens (norms, residual adds and '
                        'the MoE dispatch on that share); needs --tp > 1')
    p.add_argument('--max-prefill-token-num', type=int, default=4096,
                   help='tokens one prefill step carries at most while nothing decodes')
    p.add_argument('--max-mixed-token-num', type=int, default=4096,
                   help='tokens a step carries at most while sequences decode: their decode rows '
                        'plus a prefill chunk (0: prefill steps apart, running streams wait)')
    p.add_argument('--max-mixed-step-cost', type=float, default=0.0,
                   help='> 1: the mixed budget follows measured step times, a step carrying a '
                        'prompt chunk costing at most this many decode steps (0: fixed)')
    p.add_argument('--log-level', default='WARNING', type=str.upper, choices=LOG_LEVELS,
                   help='python logging level')


def sampling_args(p: argparse.ArgumentParser):
    p.add_argument('--max-new-tokens', type=int, default=128, help='tokens to generate at most')
    p.add_argument('--temperature', type=float, default=0.0, help='0 = greedy')
    p.add_argument('--top-p', type=float, default=1.0, help='nucleus sampling mass')
    p.add_argument('--top-k', type=int, default=0, help='0 = off')
    p.add_argument('--repetition-penalty', type=float, default=1.0,
                   help='a token of the prompt or output: logit / P if positive, else x P '
                        '(1.0 = off)')
    p.add_argument('--presence-penalty', type=float, default=0.0,
                   help='logit -= P for each token the output holds (0.0 = off)')
    p.add_argument('--frequency-penalty', type=float, default=0.0,
                   help='logit -= P x the times the output holds the token (0.0 = off)')
    p.add_argument('--seed', type=int, default=None, help='random seed for sampling')


def speculative_config(args):
    if args.speculative_algorithm == 'extract_hidden_states':
        return SpeculativeConfig(method='extract_hidden_states',
                                 aux_hidden_state_layer_ids=_layer_ids(
                                     args.speculative_aux_hidden_state_layer_ids),
                                 hidden_states_dir=args.hidden_states_dir)
    _refuse(args, ('speculative_aux_hidden_state_layer_ids', 'hidden_states_dir'),
            'needs --speculative-algorithm extract_hidden_states')
    if args.speculative_algorithm is None and args.speculative_num_draft_tokens is None:
        _refuse(args, ('speculative_tp', 'speculative_ep', 'speculative_draft_model',
                       'speculative_token_map'),
                'speculative decoding is off; add --speculative-num-draft-tokens K to turn it on')
        return None
    return SpeculativeConfig(method=args.speculative_algorithm or 'qwen3_5_mtp',
                             num_speculative_tokens=args.speculative_num_draft_tokens or 3,
                             model=args.speculative_draft_model, tp=args.speculative_tp,
                             ep=args.speculative_ep, dynamic=args.speculative_dynamic,
                             draft_token_map=args.speculative_token_map)


def _refuse(args, flags: tuple[str, ...], why: str):
    for flag in flags:
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')}={getattr(args, flag)}: {why}")


def _layer_ids(text: str | None) -> tuple[int, ...] | None:
    """'2,18,34' -> (2, 18, 34); the ranges are SpeculativeConfig's to check."""
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(','))
    except ValueError:
        raise ValueError(f'--speculative-aux-hidden-state-layer-ids={text!r}: must be '
                         'comma-separated layer ids, e.g. 2,18,34') from None


def build_engine_config(args) -> PytorchEngineConfig:
    """PytorchEngineConfig from the flags named as its fields (--seed seeds sampling, not the
    engine), and RAY_ADDRESS, which ray.init() reads."""
    if args.ray_address:
        os.environ['RAY_ADDRESS'] = args.ray_address
    return PytorchEngineConfig(**{f.name: getattr(args, f.name)
                                  for f in dataclasses.fields(PytorchEngineConfig)
                                  if f.name != 'seed' and hasattr(args, f.name)})
