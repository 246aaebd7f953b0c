"""Train a Qwen3.5 model's MTP draft head from hidden states extracted by the engine alone.

    # 1. extract: run the target over your data with method='extract_hidden_states' and layer
    #    L = num_hidden_layers among the ids (README "Extracting hidden states")
    lmdeploy_lite serve api_server MODEL --speculative-algorithm extract_hidden_states \
        --speculative-aux-hidden-state-layer-ids 8 --hidden-states-dir DIR    # (or pipeline())
    # 2. train a fresh head (or --init model: fine-tune the checkpoint's) from DIR's files
    python tools/train_mtp_head.py DIR --model MODEL --out OUT
    # 3. OUT is MODEL with the new mtp.* tensors: serve it, or measure its acceptance
    python benchmarks/eval_embedded_acceptance.py --model OUT

What it reads from each `DIR/*.safetensors` file: `token_ids [T]` and the column of
`hidden_states [T, n, H]` that holds layer L, the target's final-normed hidden state h_t (the
file's metadata `aux_hidden_state_layer_ids` names the columns). From MODEL: its config, and its
embedding and LM head (frozen, shared with the head as in the engine). Nothing else: no corpus,
no target forward.

The head is Qwen3.5's MTP module (lmdeploy_lite/pytorch/models/qwen3_5_mtp.py), built from
transformers' parts with the checkpoint's parameter names (as tools/train_tiny_model.py's
`MTPHead`, dense or MoE like the target):
    e = pre_fc_norm_embedding(embed_tokens(x_{t+1}));  h = pre_fc_norm_hidden(h_t)
    u = fc(cat([e, h]));  u = layers[0](u, rotary position t);  h'_t = norm(u)
and lm_head(h'_t) drafts x_{t+2}. It is trained to draft what the target would say there: the
target's own distribution at t+1, softmax(lm_head(h_{t+1})), read from the same file, is the soft
label (distillation: what greedy verification accepts is the target's argmax, not the corpus
token). As in the embedded model's training, a second, recursive step -- how it drafts for
k > 1 -- takes its own output h'_t and x_{t+2} at position t+1 and is trained on the target's
distribution at t+2, weight RECURSIVE_WEIGHT; it attends as in the engine, to the first step's
entries up to t and to itself (`two_step_mask`). Sequences are cut into windows of --seq-len tokens
(causal attention inside a window). Windows of a few files (--val-fraction) are held out: the
top-1 agreement of the head's first and second drafts with the target's argmax there is printed
(the acceptance rate of a first draft under greedy verification, roughly).
"""
from __future__ import annotations

import argparse
import fnmatch
import glob
import json
import math
import os
import random
import shutil
import time

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

RECURSIVE_WEIGHT = 0.5          # the second draft step's loss, relative to the first's
# MODEL's files that OUT keeps beside its weights: config, generation config, tokenizer
KEPT_FILES = ('config.json', 'generation_config.json', 'tokenizer*', 'special_tokens_map.json',
              'vocab.*', 'merges.txt', 'chat_template*')


# ---- the model's parts ---------------------------------------------------------------------
def text_config(model_dir: str):
    """transformers' text config of the checkpoint (Qwen3.5 dense or MoE)."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig
    with open(os.path.join(model_dir, 'config.json')) as f:
        raw = json.load(f)
    text = dict(raw.get('text_config') or raw)
    moe = 'num_experts' in text
    for key in ('architectures', 'model_type', 'transformers_version', 'dtype', 'torch_dtype'):
        text.pop(key, None)
    config = (Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig)(**text)
    config._attn_implementation = 'sdpa'
    if moe:
        config._experts_implementation = 'eager'       # a loop over experts: any device, dtype
    return config


def checkpoint_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, by name (a safetensors file or shards)."""
    tensors = {}
    for path in sorted(glob.glob(os.path.join(model_dir, '*.safetensors'))):
        with safe_open(path, 'pt') as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    if not tensors:
        raise ValueError(f'--model={model_dir!r}: no safetensors files')
    return tensors


def shared_weights(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [V, H], LM head [V, H]) of the target, in either released layout."""
    embed = next(tensors[n] for n in ('model.language_model.embed_tokens.weight',
                                      'model.embed_tokens.weight') if n in tensors)
    return embed, tensors.get('lm_head.weight', embed)


class MTPHead(nn.Module):
    """Qwen3.5's MTP module from transformers parts (module docstring); parameter names are the
    checkpoint's `mtp.*` minus `mtp.`. The embedding, LM head and rotary embedding are the
    target's, passed in, never owned."""

    def __init__(self, config):
        super().__init__()
        if hasattr(config, 'num_experts'):
            from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
                Qwen3_5MoeDecoderLayer as Layer, Qwen3_5MoeRMSNorm as Norm)
        else:
            from transformers.models.qwen3_5.modeling_qwen3_5 import (
                Qwen3_5DecoderLayer as Layer, Qwen3_5RMSNorm as Norm)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = Norm(hidden, eps)
        self.pre_fc_norm_hidden = Norm(hidden, eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Layer(config, config.layer_types.index('full_attention'))])
        self.norm = Norm(hidden, eps)

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, embed: nn.Embedding,
                rotary_emb: nn.Module, positions: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """next_ids [B, n] = x_{t+1}; hidden [B, n, H] = h_t, at `positions` [n]; `mask`
        [n, n] bool (True: may attend), None: causal -> h'_t [B, n, H]."""
        batch, n = next_ids.shape
        u = self.fc(torch.cat([self.pre_fc_norm_embedding(embed(next_ids)),
                               self.pre_fc_norm_hidden(hidden)], dim=-1))
        rope = rotary_emb(u, positions.view(1, 1, n).expand(3, batch, n))
        mask = None if mask is None else mask[None, None]
        return self.norm(self.layers[0](u, position_embeddings=rope, attention_mask=mask))


def rotary_embedding(config) -> nn.Module:
    """transformers' rotary embedding of the target (dense or MoE), shared with the head."""
    if hasattr(config, 'num_experts'):
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeTextRotaryEmbedding as Rotary)
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import (
            Qwen3_5TextRotaryEmbedding as Rotary)
    return Rotary(config)


def two_step_mask(n: int) -> torch.Tensor:
    """[2n, 2n] bool: n first-step rows (positions 0..n-1, causal) then n second-step rows,
    second step j at position j + 1 seeing the first step's rows 0..j and itself: what the
    engine's head sees drafting its second token (its KV cache holds first-step entries up to
    the last accepted position t, then the draft's own entry at t + 1)."""
    first = torch.ones(n, n, dtype=torch.bool).tril()
    mask = torch.zeros(2 * n, 2 * n, dtype=torch.bool)
    mask[:n, :n] = first
    mask[n:, :n] = first
    mask[n:, n:] = torch.eye(n, dtype=torch.bool)
    return mask


@torch.no_grad()
def init_fresh(head: MTPHead, seed: int):
    """Matrices and experts normal(0, 0.02); the zero-centred norms (scale 1 + w) 0."""
    generator = torch.Generator().manual_seed(seed)
    for param in head.parameters():
        if param.dim() >= 2:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        else:
            param.zero_()


# ---- data ----------------------------------------------------------------------------------
def load_windows(directory: str, num_layers: int, seq_len: int
                 ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(file, token ids [n], h [n, H] float32) windows of at most `seq_len` tokens (at least 3)
    from every file of `directory`, in file order."""
    paths = sorted(glob.glob(os.path.join(directory, '*.safetensors')))
    if not paths:
        raise ValueError(f'DIR={directory!r}: no .safetensors files (extract some first)')
    windows = []
    for path in paths:
        with safe_open(path, 'pt') as f:
            ids = (f.metadata() or {}).get('aux_hidden_state_layer_ids')
            if ids is None:
                raise ValueError(f'{path}: no aux_hidden_state_layer_ids in its metadata')
            columns = [int(i) for i in ids.split(',')]
            if num_layers not in columns:
                raise ValueError(f'{path}: holds layers {columns}, not {num_layers} (the '
                                 f'final-normed hidden state the MTP head reads); extract with '
                                 f'{num_layers} among --speculative-aux-hidden-state-layer-ids')
            tokens = f.get_tensor('token_ids')
            hidden = f.get_slice('hidden_states')[:, columns.index(num_layers)].float()
        for start in range(0, len(tokens), seq_len):
            if len(tokens) - start >= 3:
                windows.append((path, tokens[start:start + seq_len],
                                hidden[start:start + seq_len]))
    return windows


def split_by_file(windows: list, val_fraction: float, seed: int) -> tuple[list, list]:
    files = sorted({w[0] for w in windows})
    random.Random(seed).shuffle(files)
    held = set(files[:round(len(files) * val_fraction)]) if len(files) > 1 else set()
    return [w for w in windows if w[0] not in held], [w for w in windows if w[0] in held]


def batches(windows: list, batch_size: int, rng: random.Random):
    """Endless shuffled batches: (ids [B, n], h [B, n, H], mask [B, n]) padded at the end
    (causal attention: padding never reaches a real position)."""
    while True:
        order = list(range(len(windows)))
        rng.shuffle(order)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield collate([windows[j] for j in order[i:i + batch_size]])


def collate(group: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = max(len(w[1]) for w in group)
    hidden_size = group[0][2].shape[-1]
    ids = torch.zeros(len(group), n, dtype=torch.long)
    hidden = torch.zeros(len(group), n, hidden_size)
    mask = torch.zeros(len(group), n, dtype=torch.bool)
    for b, (_, tokens, h) in enumerate(group):
        ids[b, :len(tokens)], hidden[b, :len(tokens)], mask[b, :len(tokens)] = tokens, h, True
    return ids, hidden, mask


# ---- training ------------------------------------------------------------------------------
class Trainer:
    def __init__(self, config, head: MTPHead, embed: torch.Tensor, lm_head: torch.Tensor):
        self.head = head
        self.rotary = rotary_embedding(config)
        self.embed = nn.Embedding.from_pretrained(embed.float(), freeze=True)
        self.lm_head = lm_head.float()

    def outputs(self, ids: torch.Tensor, hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(first-step logits [B, n-1, V] at t = 0..n-2, their targets' logits = the target's at
        t+1, second-step logits [B, n-2, V], their targets' logits at t+2). The second step
        attends as in the engine (`two_step_mask`): the first step's rows run again beside it,
        on the same weights, in one forward of 2(n-2) rows."""
        n = ids.shape[1] - 2
        first = self.head(ids[:, 1:], hidden[:, :-1], self.embed, self.rotary,
                          torch.arange(n + 1))
        both = self.head(torch.cat([ids[:, 1:-1], ids[:, 2:]], 1),
                         torch.cat([hidden[:, :-2], first[:, :-1]], 1), self.embed, self.rotary,
                         torch.cat([torch.arange(n), torch.arange(1, n + 1)]), two_step_mask(n))
        with torch.no_grad():
            target = hidden @ self.lm_head.T
        return (first @ self.lm_head.T, target[:, 1:], both[:, n:] @ self.lm_head.T,
                target[:, 2:])

    @staticmethod
    def soft_ce(logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor
                ) -> torch.Tensor:
        per = -(target_logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
        return (per * mask).sum() / mask.sum().clamp_min(1)

    def loss(self, ids, hidden, mask) -> tuple[torch.Tensor, float, float]:
        first, target1, second, target2 = self.outputs(ids, hidden)
        loss1 = self.soft_ce(first, target1, mask[:, 1:])
        loss2 = self.soft_ce(second, target2, mask[:, 2:])
        return loss1 + RECURSIVE_WEIGHT * loss2, loss1.item(), loss2.item()

    @torch.no_grad()
    def agreement(self, windows: list, batch_size: int) -> tuple[float, float]:
        """Top-1 agreement of the first and second drafts with the target's argmax."""
        hits, counts = [0, 0], [0, 0]
        for i in range(0, len(windows), batch_size):
            ids, hidden, mask = collate(windows[i:i + batch_size])
            first, target1, second, target2 = self.outputs(ids, hidden)
            for j, (q, p, m) in enumerate(((first, target1, mask[:, 1:]),
                                           (second, target2, mask[:, 2:]))):
                hits[j] += ((q.argmax(-1) == p.argmax(-1)) & m).sum().item()
                counts[j] += m.sum().item()
        return hits[0] / max(1, counts[0]), hits[1] / max(1, counts[1])


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def save_model(model_dir: str, out_dir: str, tensors: dict[str, torch.Tensor], head: MTPHead):
    """OUT = MODEL's files with the head's `mtp.*` tensors (in the checkpoint's dtype) in place
    of any it had: one model.safetensors beside MODEL's config and tokenizer files."""
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(model_dir):
        source = os.path.join(model_dir, name)
        if os.path.isfile(source) and any(fnmatch.fnmatch(name, p) for p in KEPT_FILES):
            shutil.copy(source, os.path.join(out_dir, name))
    dtype = next(t.dtype for n, t in tensors.items() if n.endswith('embed_tokens.weight'))
    merged = {n: t for n, t in tensors.items() if not n.startswith('mtp.')}
    merged.update({f'mtp.{n}': t.detach().to(dtype).contiguous()
                   for n, t in head.state_dict().items()})
    save_file(merged, os.path.join(out_dir, 'model.safetensors'), metadata={'format': 'pt'})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('dir', help='the extracted files (DIR/*.safetensors)')
    parser.add_argument('--model', required=True, help='the target checkpoint directory')
    parser.add_argument('--out', required=True, help='MODEL with the trained mtp.* tensors')
    parser.add_argument('--init', choices=('fresh', 'model'), default='fresh',
                        help="fresh: a new head; model: fine-tune MODEL's own mtp.* head")
    parser.add_argument('--steps', type=int, default=600)
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--seq-len', type=int, default=512)
    parser.add_argument('--lr', type=float, default=2e-3)
    parser.add_argument('--warmup', type=int, default=30)
    parser.add_argument('--weight-decay', type=float, default=0.1)
    parser.add_argument('--val-fraction', type=float, default=0.05)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--time-budget', type=float, default=None,
                        help='stop after this many seconds of training (the schedule is '
                             'fitted to it after 10 steps)')
    parser.add_argument('--log-every', type=int, default=50)
    parser.add_argument('--threads', type=int, default=None,
                        help="torch threads (default: torch's); 1 on a shared machine, where "
                             'waiting OpenMP threads cost far more than they add')
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    start = time.time()
    torch.manual_seed(args.seed)
    config = text_config(args.model)
    tensors = checkpoint_tensors(args.model)
    embed, lm_head = shared_weights(tensors)
    head = MTPHead(config)
    if args.init == 'model':
        own = {n[len('mtp.'):]: t.float() for n, t in tensors.items() if n.startswith('mtp.')}
        head.load_state_dict(own)
    else:
        init_fresh(head, args.seed)
    windows = load_windows(args.dir, config.num_hidden_layers, args.seq_len)
    train, val = split_by_file(windows, args.val_fraction, args.seed)
    num_tokens = sum(len(w[1]) for w in train)
    print(f'{len(train)} training windows ({num_tokens} tokens), {len(val)} held out, from '
          f'{args.dir}; head: {sum(p.numel() for p in head.parameters()) / 1e6:.2f} M '
          f'parameters ({args.init})', flush=True)
    trainer = Trainer(config, head, embed, lm_head)
    decay = [p for p in head.parameters() if p.dim() >= 2]
    no_decay = [p for p in head.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{'params': decay, 'weight_decay': args.weight_decay},
                                   {'params': no_decay, 'weight_decay': 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    if val:
        print('held out before: first/second draft agreement %.3f / %.3f'
              % trainer.agreement(val, args.batch_size), flush=True)
    data = batches(train, min(args.batch_size, len(train)), random.Random(args.seed))
    total, t_train, step = args.steps, time.time(), 0
    head.train()
    while step < total:
        if step == 10 and args.time_budget:
            per_step = (time.time() - t_train) / 10
            total = max(11, min(args.steps, int(args.time_budget / per_step)))
            print(f'{per_step:.2f} s/step -> {total} steps in {args.time_budget:.0f} s',
                  flush=True)
        for group in optimizer.param_groups:
            group['lr'] = lr_at(step, total, args.lr, args.warmup)
        loss, loss1, loss2 = trainer.loss(*next(data))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % args.log_every == 0 or step in (1, total):
            print(f'step {step}/{total} loss {loss.item():.4f} (first {loss1:.4f}, second '
                  f'{loss2:.4f}) {time.time() - t_train:.0f} s', flush=True)
    head.eval()
    if val:
        print('held out after: first/second draft agreement %.3f / %.3f'
              % trainer.agreement(val, args.batch_size), flush=True)
    save_model(args.model, args.out, tensors, head)
    print(f'saved {args.out} ({step} steps, {time.time() - start:.0f} s)')


if __name__ == '__main__':
    main()
