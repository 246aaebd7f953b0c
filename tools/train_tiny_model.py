"""Train the embedded default model: a tiny Qwen3.5-MoE with its MTP head, on the Python standard
library's own `.py` files (tests included), and save it in the released Qwen3.5 checkpoint layout.

    # 1. byte-level BPE tokenizer (a minute, any machine; the shipped one: CPython 3.11's stdlib)
    python tools/train_tiny_model.py tokenizer --out lmdeploy_lite/assets/qwen3_5_moe_tiny
    # 2. model + MTP head, jointly (one H100/H200, ~7.5 minutes of training; CPU works, slowly)
    python tools/train_tiny_model.py train --tokenizer lmdeploy_lite/assets/qwen3_5_moe_tiny \
        [--stdlib DIR] --out OUT

Corpus: every `.py` file under the running interpreter's stdlib directory, or `--stdlib DIR`
(`site-packages` and `__pycache__` skipped, files that are not UTF-8 skipped), files joined with
`<|endoftext|>`. The GPU machines' Ubuntu python3.12 ships no `test/` package (10 MB of source
only), so the shipped model was trained on CPython 3.11.7's full stdlib (31 MB with tests) carried
there as a tarball: `--stdlib /tmp/corpus/python3.11`. The
modules in `HELD_OUT` (and their tests) are never trained on, by the tokenizer or the model; they
give the held-out perplexity here and the prompts of `benchmarks/eval_embedded_acceptance.py`.

Model: transformers' `Qwen3_5MoeForCausalLM` plus `MTPHead`, built from transformers parts
exactly as Qwen3.5's MTP module (qwen3_5.md section 3):
    e = pre_fc_norm_embedding(embed_tokens(x_{t+1}));  h = pre_fc_norm_hidden(h_t)
    u = fc(cat([e, h]));  u = layers[0](u, rotary position t);  logits = lm_head(norm(u)) -> x_{t+2}
with h_t the target's post-final-norm hidden state. Loss = CE(x_{t+1}) + MTP_WEIGHT * CE(x_{t+2})
+ MTP_RECURSIVE_WEIGHT * CE(x_{t+3}) of the head's second step on its own output (how it drafts
for k > 1) + a small router load-balancing term. The gated delta rule runs on transformers'
pure-PyTorch fallback (fla-core's Triton backward is wrong on Hopper with Triton 3.6; do not
install it here).

Importing this module has no side effects: the tests and the acceptance benchmark import `MTPHead`,
`HELD_OUT` and `held_out_files` from it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch import nn

SPECIAL_TOKENS = ['<|endoftext|>', '<|im_start|>', '<|im_end|>']
EOS_TOKEN = '<|endoftext|>'
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                 "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Held out from the tokenizer and the model: modules present in CPython 3.11 and 3.12 alike, paths
# relative to the stdlib directory; a trailing '/' holds out a whole package.
HELD_OUT = (
    'argparse.py', 'difflib.py', 'fractions.py', 'heapq.py', 'json/', 'textwrap.py',
    'test/test_argparse.py', 'test/test_difflib.py', 'test/test_fractions.py',
    'test/test_heapq.py', 'test/test_json/', 'test/test_textwrap.py',
)
MTP_WEIGHT = 0.5
MTP_RECURSIVE_WEIGHT = 0.25     # the head's second step on its own output (drafting k > 1)
ROUTER_AUX_WEIGHT = 0.01
# vocab_size and eos_token_id are filled from the tokenizer.
TEXT_CONFIG = dict(
    hidden_size=256, num_hidden_layers=8,
    layer_types=['linear_attention'] * 3 + ['full_attention'] + ['linear_attention'] * 3
    + ['full_attention'],
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
    linear_value_head_dim=64, linear_conv_kernel_dim=4,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
    shared_expert_intermediate_size=256,
    rms_norm_eps=1e-6, max_position_embeddings=4096, mtp_num_hidden_layers=1,
    rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0, 'partial_rotary_factor': 0.5,
                     'mrope_section': [6, 5, 5], 'mrope_interleaved': True},
    tie_word_embeddings=False, initializer_range=0.02, router_aux_loss_coef=ROUTER_AUX_WEIGHT,
)


# ---- corpus ------------------------------------------------------------------------------------
def stdlib_dir() -> str:
    return sysconfig.get_paths()['stdlib']


def _is_held_out(rel: str) -> bool:
    return any(rel == h or (h.endswith('/') and rel.startswith(h)) for h in HELD_OUT)


def corpus_files(root: str | None = None) -> tuple[list[str], list[str]]:
    """(training files, held-out files): absolute paths of the stdlib's `.py` files, sorted."""
    root = root or stdlib_dir()
    train, held = [], []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ('site-packages', 'dist-packages',
                                                      '__pycache__'))
        for name in sorted(files):
            if name.endswith('.py'):
                path = os.path.join(d, name)
                rel = os.path.relpath(path, root).replace(os.sep, '/')
                (held if _is_held_out(rel) else train).append(path)
    return train, held


def held_out_files(root: str | None = None) -> list[str]:
    return corpus_files(root)[1]


def read_texts(paths: list[str]) -> list[str]:
    """File contents; files that are not valid UTF-8 are left out."""
    texts = []
    for path in paths:
        try:
            with open(path, encoding='utf-8') as f:
                texts.append(f.read())
        except (UnicodeDecodeError, OSError):
            pass
    return texts


def encode_texts(tokenizer, texts: list[str], eos_id: int) -> torch.Tensor:
    """One token stream [N] (int64): each file followed by `<|endoftext|>`."""
    ids = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


# ---- tokenizer ---------------------------------------------------------------------------------
def train_tokenizer(out_dir: str, vocab_size: int = 4096) -> None:
    """Byte-level BPE on the training files, saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    train, _ = corpus_files()
    texts = read_texts(train)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                   model_max_length=TEXT_CONFIG['max_position_embeddings'])
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    config_path = os.path.join(out_dir, 'tokenizer_config.json')
    with open(config_path) as f:
        tok_config = json.load(f)
    tok_config['chat_template'] = CHAT_TEMPLATE             # in tokenizer_config.json itself
    with open(config_path, 'w') as f:
        json.dump(tok_config, f, indent=2)
    num_tokens = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    print(f'tokenizer: vocab {tok.get_vocab_size()}, trained on {len(texts)} files of '
          f'{stdlib_dir()} (Python {sys.version.split()[0]}), {num_tokens} tokens -> {out_dir}')


# ---- model -------------------------------------------------------------------------------------
def make_text_config(vocab_size: int, eos_token_id: list[int]):
    """eos_token_id: [<|endoftext|>, <|im_end|>]."""
    from transformers import Qwen3_5MoeTextConfig
    config = Qwen3_5MoeTextConfig(
        vocab_size=vocab_size, eos_token_id=eos_token_id, pad_token_id=eos_token_id[0],
        partial_rotary_factor=TEXT_CONFIG['rope_parameters']['partial_rotary_factor'],
        **TEXT_CONFIG)
    config._attn_implementation = 'sdpa'
    return config


class MTPHead(nn.Module):
    """The Qwen3.5 MTP module from transformers parts (qwen3_5.md section 3). Parameter names equal
    the checkpoint's `mtp.*` names minus `mtp.`; embed_tokens, rotary embedding and lm_head are
    the target's, passed to `forward`, never owned."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(hidden, eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        full_idx = config.layer_types.index('full_attention')
        self.layers = nn.ModuleList([Qwen3_5MoeDecoderLayer(config, full_idx)])
        self.norm = Qwen3_5MoeRMSNorm(hidden, eps)

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, embed_tokens: nn.Module,
                rotary_emb: nn.Module, start_position: int = 0) -> torch.Tensor:
        """next_ids [B, n] = x_{t+1}; hidden [B, n, H] = the target's post-norm h_t for positions
        t = start_position .. start_position+n-1 (causal over those n, no cache).
        Returns the post-`norm` hidden [B, n, H]; lm_head of it predicts x_{t+2}."""
        batch, n = next_ids.shape
        e = self.pre_fc_norm_embedding(embed_tokens(next_ids))
        h = self.pre_fc_norm_hidden(hidden)
        u = self.fc(torch.cat([e, h], dim=-1))
        positions = torch.arange(start_position, start_position + n, device=u.device)
        rope = rotary_emb(u, positions.view(1, 1, n).expand(3, batch, n))
        mask = None
        if self.layers[0].self_attn.config._attn_implementation != 'sdpa':
            mask = torch.full((n, n), float('-inf'), device=u.device).triu(1)[None, None]
        u = self.layers[0](u, position_embeddings=rope, attention_mask=mask)
        return self.norm(u)


class TinyModel(nn.Module):
    """Target (`Qwen3_5MoeForCausalLM`) + MTP head, trained jointly."""

    def __init__(self, config):
        super().__init__()
        from transformers import Qwen3_5MoeForCausalLM
        self.target = Qwen3_5MoeForCausalLM(config)
        self.mtp = MTPHead(self.target.config)
        for module in self.mtp.modules():                   # transformers' init for the new parts
            self.target._init_weights(module)

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """tokens [B, T+1] -> cross-entropies and logits. Position t sees x_{<=t}; the target
        predicts x_{t+1}; the MTP head with (h_t, x_{t+1}) at position t predicts x_{t+2}; the
        head's second, recursive step -- as in drafting k > 1 -- takes its own output at t and
        x_{t+2} at position t+1 and predicts x_{t+3}."""
        inputs = tokens[:, :-1]
        body = self.target.model
        hidden = body(input_ids=inputs).last_hidden_state               # post-final-norm
        logits = self.target.lm_head(hidden)
        mtp_hidden = self.mtp(tokens[:, 1:-1], hidden[:, :-1], body.embed_tokens, body.rotary_emb)
        mtp_logits = self.target.lm_head(mtp_hidden)
        mtp2_hidden = self.mtp(tokens[:, 2:-1], mtp_hidden[:, :-1], body.embed_tokens,
                               body.rotary_emb, start_position=1)
        mtp2_logits = self.target.lm_head(mtp2_hidden)
        return {
            'loss': F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()),
            'mtp_loss': F.cross_entropy(mtp_logits.flatten(0, 1).float(), tokens[:, 2:].flatten()),
            'mtp2_loss': F.cross_entropy(mtp2_logits.flatten(0, 1).float(),
                                         tokens[:, 3:].flatten()),
            'logits': logits, 'mtp_logits': mtp_logits, 'mtp2_logits': mtp2_logits,
        }


class RouterBalance:
    """Collects every MoE router's logits (target and MTP) through forward hooks and gives the
    Switch-style load-balancing loss E * sum_i f_i * P_i, averaged over routers."""

    def __init__(self, model: nn.Module):
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter
        self.logits: list[torch.Tensor] = []
        for module in model.modules():
            if isinstance(module, Qwen3_5MoeTopKRouter):
                module.register_forward_hook(self._record)

    def _record(self, module, inputs, out):
        self.logits.append((out[0], module.top_k))

    def pop_loss(self) -> torch.Tensor:
        losses = []
        for logits, top_k in self.logits:
            probs = logits.float().softmax(-1)
            num_experts = probs.shape[-1]
            chosen = F.one_hot(probs.topk(top_k, dim=-1).indices, num_experts).sum(1).float()
            losses.append(num_experts * (chosen.mean(0) / top_k * probs.mean(0)).sum())
        self.logits = []
        return torch.stack(losses).mean()


def _use_autocast_experts(config) -> str:
    """Register an experts implementation that runs transformers' grouped_mm on autocast-dtype
    copies of the fp32 master weights (grouped_mm is not autocast-aware). Returns its name."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward

    class _CastView:
        def __init__(self, experts, dtype):
            self._experts = experts
            self.gate_up_proj = experts.gate_up_proj.to(dtype)
            self.down_proj = experts.down_proj.to(dtype)

        def __getattr__(self, name):
            return getattr(self._experts, name)

        def _apply_gate(self, gate_up_out):
            return self._experts._apply_gate(gate_up_out)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        device_type = hidden_states.device.type
        if not torch.is_autocast_enabled(device_type):
            return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
        dtype = torch.get_autocast_dtype(device_type)
        out = grouped_mm_experts_forward(_CastView(self, dtype), hidden_states.to(dtype),
                                         top_k_index, top_k_weights.to(dtype))
        return out

    ALL_EXPERTS_FUNCTIONS.register('grouped_mm_autocast', forward)
    return 'grouped_mm_autocast'


def choose_experts_implementation(model: TinyModel, device: torch.device, amp: bool) -> str:
    """grouped_mm under autocast if a forward+backward through one MoE block works and matches
    eager; else eager (a loop over experts)."""
    name = _use_autocast_experts(model.target.config)
    config = model.target.config
    block = model.target.model.layers[0].mlp
    x = torch.randn(64, 8, config.hidden_size, device=device)
    results = {}
    for impl in ('eager', name):
        config._experts_implementation = impl
        try:
            with torch.autocast(device.type, torch.bfloat16, enabled=amp):
                out = block(x)
            out.float().square().mean().backward()
            results[impl] = out.float().detach()
        except Exception as exc:                                        # noqa: BLE001
            print(f'experts implementation {impl!r} failed: {type(exc).__name__}: {exc}')
        block.zero_grad(set_to_none=True)
    chosen = 'eager'
    if name in results:
        err = ((results[name] - results['eager']).norm() / results['eager'].norm()).item()
        print(f'experts implementation {name!r}: relative difference to eager {err:.2e}')
        if err < 2e-2:
            chosen = name
    config._experts_implementation = chosen
    return chosen


# ---- training ----------------------------------------------------------------------------------
def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup, then cosine from `peak` down to `floor * peak` at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


class Batches:
    """Windows of T+1 tokens from the stream: each epoch a new random shift and order (seeded)."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        self.stream, self.seq_len, self.batch_size = stream, seq_len, batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.epoch, self.order, self.pos = -1, torch.empty(0, dtype=torch.long), 0

    def next(self) -> torch.Tensor:
        if self.pos + self.batch_size > len(self.order):
            self.epoch += 1
            shift = int(torch.randint(0, self.seq_len, (1,), generator=self.gen))
            count = (len(self.stream) - shift - 1) // self.seq_len
            self.order = shift + self.seq_len * torch.randperm(count, generator=self.gen)
            self.pos = 0
        starts = self.order[self.pos:self.pos + self.batch_size]
        self.pos += self.batch_size
        offsets = torch.arange(self.seq_len + 1)
        return self.stream[starts[:, None] + offsets[None]]


@torch.no_grad()
def evaluate(model: TinyModel, stream: torch.Tensor, seq_len: int, batch_size: int,
             device: torch.device, max_windows: int | None = None) -> dict[str, float]:
    """Teacher-forced metrics over consecutive windows of the stream (float32, no autocast):
    loss/perplexity of the target, MTP loss and top-1 accuracy on x_{t+2}, and the MTP's top-1
    agreement with the target's own greedy next-next token (argmax of the target at t+1) -- the
    rate at which a first draft token would be accepted under greedy verification."""
    model.eval()
    count = (len(stream) - 1) // seq_len
    if max_windows is not None:
        count = min(count, max_windows)
    sums = dict(loss=0.0, mtp_loss=0.0, acc=0.0, mtp_acc=0.0, mtp_agree=0.0, mtp2_loss=0.0,
                mtp2_acc=0.0, mtp2_agree=0.0)
    counts = dict(main=0, mtp=0, mtp2=0)
    for first in range(0, count, batch_size):
        starts = torch.arange(first, min(count, first + batch_size)) * seq_len
        batch = stream[starts[:, None] + torch.arange(seq_len + 1)[None]].to(device)
        out = model(batch)
        n = dict(main=batch[:, 1:].numel(), mtp=batch[:, 2:].numel(), mtp2=batch[:, 3:].numel())
        target_next = out['logits'].argmax(-1)                        # [B, T]: guess of x_{t+1}
        mtp_guess = out['mtp_logits'].argmax(-1)                      # [B, T-1]: guess of x_{t+2}
        mtp2_guess = out['mtp2_logits'].argmax(-1)                    # [B, T-2]: guess of x_{t+3}
        sums['loss'] += out['loss'].item() * n['main']
        sums['mtp_loss'] += out['mtp_loss'].item() * n['mtp']
        sums['mtp2_loss'] += out['mtp2_loss'].item() * n['mtp2']
        sums['acc'] += (target_next == batch[:, 1:]).sum().item()
        sums['mtp_acc'] += (mtp_guess == batch[:, 2:]).sum().item()
        sums['mtp_agree'] += (mtp_guess == target_next[:, 1:]).sum().item()
        sums['mtp2_acc'] += (mtp2_guess == batch[:, 3:]).sum().item()
        sums['mtp2_agree'] += (mtp2_guess == target_next[:, 2:]).sum().item()
        for key in counts:
            counts[key] += n[key]
    model.train()
    result = {k: v / counts['mtp2' if k.startswith('mtp2') else 'mtp' if k.startswith('mtp')
                            else 'main'] for k, v in sums.items()}
    result['ppl'] = math.exp(result['loss'])
    result['mtp_ppl'] = math.exp(result['mtp_loss'])
    result['tokens'] = counts['main']
    return result


def checkpoint_tensors(model: TinyModel) -> dict[str, torch.Tensor]:
    """Released Qwen3.5 names, bf16: model.language_model.*, lm_head.weight, mtp.*."""
    tensors = {}
    for name, tensor in model.target.state_dict().items():
        if name.startswith('model.'):
            name = 'model.language_model.' + name[len('model.'):]
        tensors[name] = tensor
    for name, tensor in model.mtp.state_dict().items():
        tensors['mtp.' + name] = tensor
    return {k: v.detach().to('cpu', torch.bfloat16).contiguous() for k, v in tensors.items()}


def save_checkpoint(model: TinyModel, out_dir: str, shard_bytes: int = 14 << 20) -> list[str]:
    """config.json (top level `qwen3_5_moe`, `text_config`) + bf16 safetensors, sharded so that no
    file exceeds `shard_bytes`. Returns the file names written."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    tensors = checkpoint_tensors(model)
    text_config = model.target.config.to_dict()
    for key in ('transformers_version', 'architectures', 'dtype', 'torch_dtype', '_name_or_path',
                'output_router_logits', 'output_hidden_states', 'output_attentions', 'return_dict',
                'chunk_size_feed_forward', 'is_encoder_decoder', 'id2label', 'label2id',
                'problem_type'):
        text_config.pop(key, None)
    config = {
        'architectures': ['Qwen3_5MoeForConditionalGeneration'],
        'model_type': 'qwen3_5_moe',
        'text_config': text_config,
        'tie_word_embeddings': text_config['tie_word_embeddings'],
        'dtype': 'bfloat16',
    }
    with open(os.path.join(out_dir, 'config.json'), 'w') as f:
        json.dump(config, f, indent=2)
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, 'model.safetensors'), metadata={'format': 'pt'})
        return ['config.json', 'model.safetensors']
    names, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors'
        save_file(shard, os.path.join(out_dir, fname), metadata={'format': 'pt'})
        weight_map.update({n: fname for n in shard})
        names.append(fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out_dir, 'model.safetensors.index.json'), 'w') as f:
        json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)
    return ['config.json', *names, 'model.safetensors.index.json']


def train(args) -> None:
    from tokenizers import Tokenizer
    t_start = time.time()
    torch.manual_seed(args.seed)
    device = torch.device(args.device or ('cuda' if torch.cuda.is_available() else 'cpu'))
    amp = args.amp == 'on' or (args.amp == 'auto' and device.type == 'cuda')
    if device.type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    print(f'python {sys.version.split()[0]}, torch {torch.__version__}, device {device}'
          + (f' ({torch.cuda.get_device_name(device)})' if device.type == 'cuda' else ''))

    import importlib.util
    if importlib.util.find_spec('fla') is not None:
        print('WARNING: fla is importable; transformers may use its gated-delta kernels, whose '
              'backward is wrong on Hopper with Triton 3.6')
    tokenizer = Tokenizer.from_file(os.path.join(args.tokenizer, 'tokenizer.json'))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    train_files, held_files = corpus_files(args.stdlib)
    train_texts, held_texts = read_texts(train_files), read_texts(held_files)
    train_stream = encode_texts(tokenizer, train_texts, eos_id)
    held_stream = encode_texts(tokenizer, held_texts, eos_id)
    corpus = dict(stdlib=args.stdlib or stdlib_dir(), python=sys.version.split()[0],
                  train_files=len(train_texts),
                  train_bytes=sum(len(t.encode()) for t in train_texts),
                  train_tokens=len(train_stream), held_out_files=len(held_texts),
                  held_out_tokens=len(held_stream), held_out=list(HELD_OUT),
                  skipped_files=len(train_files) + len(held_files) - len(train_texts)
                  - len(held_texts))
    print('corpus:', json.dumps(corpus))

    config = make_text_config(tokenizer.get_vocab_size(),
                              [eos_id, tokenizer.token_to_id('<|im_end|>')])
    model = TinyModel(config).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    n_target = sum(p.numel() for p in model.target.parameters())
    experts_impl = choose_experts_implementation(model, device, amp)
    print(f'params: {n_params / 1e6:.2f} M total, target {n_target / 1e6:.2f} M, '
          f'MTP {(n_params - n_target) / 1e6:.2f} M; experts: {experts_impl}; amp: {amp}')

    balance = RouterBalance(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{'params': decay, 'weight_decay': args.weight_decay}, {'params': no_decay,
                                                                 'weight_decay': 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == 'cuda')
    batches = Batches(train_stream, args.seq_len, args.batch_size, args.seed)
    total_steps = args.max_steps
    curve, t_train, timed_from = [], time.time(), None
    step = 0
    while step < total_steps:
        if step == 5:
            if device.type == 'cuda':
                torch.cuda.synchronize()
            timed_from = time.time()
        if step == 25 and args.time_budget:      # fit the cosine schedule into the time budget
            if device.type == 'cuda':
                torch.cuda.synchronize()
            per_step = (time.time() - timed_from) / 20
            budget_left = args.time_budget - (time.time() - t_train)
            total_steps = max(26, min(args.max_steps, 25 + int(budget_left / per_step)))
            print(f'{per_step * 1e3:.0f} ms/step -> {total_steps} steps in the '
                  f'{args.time_budget:.0f} s budget')
        lr = lr_at(step, total_steps, args.lr, args.warmup)
        for group in optimizer.param_groups:
            group['lr'] = lr
        batch = batches.next().to(device, non_blocking=True)
        with torch.autocast(device.type, torch.bfloat16, enabled=amp):
            out = model(batch)
            aux = balance.pop_loss()
            loss = (out['loss'] + MTP_WEIGHT * out['mtp_loss']
                    + MTP_RECURSIVE_WEIGHT * out['mtp2_loss'] + ROUTER_AUX_WEIGHT * aux)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        step += 1
        if step % args.log_every == 0 or step == total_steps or step == 1:
            row = dict(step=step, loss=out['loss'].item(), mtp_loss=out['mtp_loss'].item(),
                       mtp2_loss=out['mtp2_loss'].item(), aux=aux.item(),
                       grad_norm=grad_norm.item(), lr=lr,
                       tokens=step * args.batch_size * args.seq_len,
                       elapsed=round(time.time() - t_train, 1), epoch=batches.epoch)
            curve.append(row)
            print(' '.join(f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}'
                           for k, v in row.items()), flush=True)
        if args.time_budget and time.time() - t_train > args.time_budget * 1.08:
            print(f'stopping at step {step}: over the time budget')
            break
    train_seconds = time.time() - t_train

    # what the engine sees: bf16 weights, float32 arithmetic
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16).float()
    files = save_checkpoint(model, args.out)
    print(f'saved {files} to {args.out}', flush=True)
    with torch.autocast(device.type, enabled=False):
        torch.backends.cuda.matmul.allow_tf32 = False
        held = evaluate(model, held_stream, args.seq_len, args.batch_size, device,
                        max_windows=args.eval_windows)
        train_eval = evaluate(model, train_stream, args.seq_len, args.batch_size, device,
                              max_windows=held['tokens'] // args.seq_len)
    metrics = dict(corpus=corpus, config=TEXT_CONFIG, params=n_params, target_params=n_target,
                   steps=step, batch_size=args.batch_size, seq_len=args.seq_len,
                   tokens_seen=step * args.batch_size * args.seq_len,
                   epochs=step * args.batch_size * args.seq_len / len(train_stream),
                   train_seconds=round(train_seconds, 1),
                   total_seconds=round(time.time() - t_start, 1), lr=args.lr,
                   mtp_weight=MTP_WEIGHT, mtp_recursive_weight=MTP_RECURSIVE_WEIGHT,
                   router_aux_weight=ROUTER_AUX_WEIGHT, seed=args.seed,
                   experts_implementation=experts_impl, amp=amp, device=str(device),
                   held_out=held, train_sample=train_eval, curve=curve, files=files)
    with open(os.path.join(args.out, 'train_metrics.json'), 'w') as f:
        json.dump(metrics, f, indent=1)
    print()
    print('| metric | held-out | train sample |')
    print('|---|---|---|')
    for key, label in (('loss', 'target loss'), ('ppl', 'target perplexity'),
                       ('acc', 'target top-1 acc (x_{t+1})'), ('mtp_loss', 'MTP loss (x_{t+2})'),
                       ('mtp_acc', 'MTP top-1 acc (x_{t+2})'),
                       ('mtp_agree', 'MTP agrees with target argmax (x_{t+2})'),
                       ('mtp2_acc', 'MTP step 2 top-1 acc (x_{t+3})'),
                       ('mtp2_agree', 'MTP step 2 agrees with target argmax (x_{t+3})')):
        print(f'| {label} | {held[key]:.4f} | {train_eval[key]:.4f} |')
    print(f'| steps / tokens / epochs | {step} / {metrics["tokens_seen"] / 1e6:.1f} M / '
          f'{metrics["epochs"]:.2f} | train {train_seconds:.0f} s, total '
          f'{metrics["total_seconds"]:.0f} s |')


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest='cmd', required=True)
    tok = sub.add_parser('tokenizer', help='train the byte-level BPE tokenizer')
    tok.add_argument('--out', required=True)
    tok.add_argument('--vocab', type=int, default=4096)
    tr = sub.add_parser('train', help='train target + MTP head, save the checkpoint')
    tr.add_argument('--tokenizer', required=True, help='directory with tokenizer.json')
    tr.add_argument('--out', required=True)
    tr.add_argument('--stdlib', default=None,
                    help="corpus root (default: the running Python's stdlib directory)")
    tr.add_argument('--device', default=None)
    tr.add_argument('--seed', type=int, default=0)
    tr.add_argument('--batch-size', type=int, default=32)
    tr.add_argument('--seq-len', type=int, default=512)
    tr.add_argument('--lr', type=float, default=2e-3)
    tr.add_argument('--warmup', type=int, default=100)
    tr.add_argument('--weight-decay', type=float, default=0.1)
    tr.add_argument('--clip', type=float, default=1.0)
    tr.add_argument('--max-steps', type=int, default=100000)
    tr.add_argument('--time-budget', type=float, default=420.0,
                    help='seconds of training; the cosine schedule is fitted to it at step 25')
    tr.add_argument('--log-every', type=int, default=50)
    tr.add_argument('--eval-windows', type=int, default=None,
                    help='evaluate on at most this many held-out windows (default: all)')
    tr.add_argument('--amp', choices=('auto', 'on', 'off'), default='auto',
                    help='bf16 autocast (auto: on CUDA only)')
    args = parser.parse_args(argv)
    if args.cmd == 'tokenizer':
        train_tokenizer(args.out, args.vocab)
    else:
        train(args)


if __name__ == '__main__':
    main()
