"""Distil a Qwen3.5 model's MTP head from its frozen target, on one GPU: the target runs over a
token stream once (its final-normed hidden states kept on the device), then the head trains on
the target's own next-token distributions over DEPTH draft steps, each attending as in the engine.

    python tools/distill_mtp_head.py --model lmdeploy_lite/assets/qwen3_5_moe_tiny \\
        --stream stream.pt --out OUT --depth 3 --steps 2400 --time-budget 100000

--stream: a torch file {'train': int tensor [N], 'held': int tensor [M]}, token streams (the
embedded model's: `encode_texts` of tools/train_tiny_model.py's `corpus_files`, training and
held-out files, as int16). The run that made the embedded model's head (one H200, 264 s):
the command above. --time-budget fits the schedule to that many seconds of training instead.
OUT gets `mtp_head.safetensors` (the head's `mtp.*` tensors in the checkpoint's dtype) and
`distill_metrics.json` (the schedule, the loss curve, the held-out agreement before and after).

tools/train_mtp_head.py trains a head from files the engine extracted (a CPU, no target forward,
two draft steps). This trains what drafting k = DEPTH uses: draft step s (0-based) at position
t + s reads x_{t+s+1} and step s-1's output (the target's h_t for s = 0) and is trained on the
target's distribution at t+s+1, softmax(lm_head(h_{t+s+1})); it attends to the first step's rows
up to t and to its own chain's rows at t+1..t+s (`chain_mask`): what the head's KV cache holds
when the engine drafts token s + 1 after accepting up to t.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_mtp_head import (MTPHead, checkpoint_tensors, lr_at,  # noqa: E402
                            rotary_embedding, shared_weights, text_config)

STEP_WEIGHTS = (1.0, 0.7, 0.5, 0.35)    # draft step s's loss weight (a step needs all before it)


def chain_mask(n: int, depth: int) -> torch.Tensor:
    """[depth * n, depth * n] bool (True: may attend): block s holds draft step s's rows, row j at
    position j + s; every block sees the first step's rows 0..j (causal), and block s also sees
    row j of blocks 1..s (the chain's own entries). depth 2 is train_mtp_head's two_step_mask."""
    mask = torch.zeros(depth * n, depth * n, dtype=torch.bool)
    causal, eye = torch.ones(n, n, dtype=torch.bool).tril(), torch.eye(n, dtype=torch.bool)
    for s in range(depth):
        mask[s * n:(s + 1) * n, :n] = causal
        for r in range(1, s + 1):
            mask[s * n:(s + 1) * n, r * n:(r + 1) * n] = eye
    return mask


def load_target(model_dir: str, config, tensors: dict, device):
    """transformers' CausalLM of the checkpoint (released layout), frozen, float32."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
    moe = hasattr(config, 'num_experts')
    model = (Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM)(config)
    state = {n.replace('model.language_model.', 'model.', 1): t for n, t in tensors.items()
             if not n.startswith('mtp.')}
    model.load_state_dict(state, strict=True)
    return model.float().to(device).eval().requires_grad_(False)


@torch.no_grad()
def target_hidden(model, stream: torch.Tensor, seq_len: int, batch: int, device) -> tuple:
    """(ids [W, seq_len] long, h [W, seq_len, H] bf16): the stream cut into windows, each run
    from its start (causal within the window), h the final-normed hidden state."""
    count = len(stream) // seq_len
    ids = stream[:count * seq_len].long().view(count, seq_len).to(device)
    hidden = torch.empty(count, seq_len, model.config.hidden_size, dtype=torch.bfloat16,
                         device=device)
    for i in range(0, count, batch):
        hidden[i:i + batch] = model.model(input_ids=ids[i:i + batch]).last_hidden_state
    return ids, hidden


class Chain:
    """The head run over DEPTH draft steps of a batch of windows, as the engine drafts."""

    def __init__(self, config, head: MTPHead, embed, lm_head, depth: int, seq_len: int, device):
        self.head, self.depth, self.n = head, depth, seq_len - depth
        self.rotary = rotary_embedding(config).to(device)
        self.embed = torch.nn.Embedding.from_pretrained(embed.float().to(device), freeze=True)
        self.lm_head = lm_head.float().to(device)
        self.masks = [chain_mask(self.n, d + 1).to(device) for d in range(depth)]
        self.positions = [torch.cat([torch.arange(self.n) + s for s in range(d + 1)]).to(device)
                          for d in range(depth)]

    def logits(self, ids: torch.Tensor, hidden: torch.Tensor) -> list[tuple]:
        """[(draft logits [B, n, V], target logits [B, n, V]) for each step s]: step s's row j
        drafts x_{j+s+2}; the target's distribution there is lm_head(h_{j+s+1})."""
        n, outs, inputs = self.n, [], []
        hidden = hidden.float()
        for s in range(self.depth):
            inputs.append((ids[:, s + 1:s + 1 + n], hidden[:, :n] if s == 0 else outs[-1]))
            out = self.head(torch.cat([i for i, _ in inputs], 1),
                            torch.cat([h for _, h in inputs], 1), self.embed, self.rotary,
                            self.positions[s], self.masks[s] if s else None)
            outs.append(out[:, s * n:])
        with torch.no_grad():
            targets = [hidden[:, s + 1:s + 1 + n] @ self.lm_head.T for s in range(self.depth)]
        return [(o @ self.lm_head.T, t) for o, t in zip(outs, targets)]

    def loss(self, ids, hidden) -> tuple[torch.Tensor, list[float]]:
        parts = [-(t.softmax(-1) * q.log_softmax(-1)).sum(-1).mean()
                 for q, t in self.logits(ids, hidden)]
        total = sum(w * p for w, p in zip(STEP_WEIGHTS, parts))
        return total, [p.item() for p in parts]

    @torch.no_grad()
    def agreement(self, ids, hidden, batch: int) -> list[float]:
        """Top-1 agreement of each draft step with the target's argmax, teacher-forced chain."""
        hits = [0] * self.depth
        for i in range(0, len(ids), batch):
            for s, (q, t) in enumerate(self.logits(ids[i:i + batch], hidden[i:i + batch])):
                hits[s] += (q.argmax(-1) == t.argmax(-1)).sum().item()
        return [round(h / (len(ids) * self.n), 4) for h in hits]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model', required=True)
    parser.add_argument('--stream', required=True)
    parser.add_argument('--out', required=True)
    parser.add_argument('--depth', type=int, default=3, choices=range(1, len(STEP_WEIGHTS) + 1))
    parser.add_argument('--seq-len', type=int, default=512)
    parser.add_argument('--batch-size', type=int, default=64)
    parser.add_argument('--lr', type=float, default=5e-4)
    parser.add_argument('--warmup', type=int, default=20)
    parser.add_argument('--weight-decay', type=float, default=0.1)
    parser.add_argument('--steps', type=int, default=100000)
    parser.add_argument('--time-budget', type=float, default=360.0)
    parser.add_argument('--device', default='cuda')
    parser.add_argument('--max-windows', type=int, default=None, help='a smoke test: fewer')
    args = parser.parse_args(argv)
    start, device = time.time(), torch.device(args.device)
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    config = text_config(args.model)
    tensors = checkpoint_tensors(args.model)
    embed, lm_head = shared_weights(tensors)
    streams = torch.load(args.stream)
    target = load_target(args.model, config, tensors, device)
    cut = slice(None, args.max_windows and args.max_windows * args.seq_len)
    train_ids, train_h = target_hidden(target, streams['train'][cut], args.seq_len,
                                       args.batch_size, device)
    held_ids, held_h = target_hidden(target, streams['held'][cut], args.seq_len,
                                     args.batch_size, device)
    del target
    print(f'target hidden states: {len(train_ids)} + {len(held_ids)} windows of {args.seq_len} '
          f'in {time.time() - start:.0f} s', flush=True)
    head = MTPHead(config).to(device)
    head.load_state_dict({n[len('mtp.'):]: t.float() for n, t in tensors.items()
                          if n.startswith('mtp.')})
    chain = Chain(config, head, embed, lm_head, args.depth, args.seq_len, device)
    head.eval()
    before = chain.agreement(held_ids, held_h, args.batch_size)
    print(f'held-out agreement before: {before}', flush=True)
    decay = [p for p in head.parameters() if p.dim() >= 2]
    rest = [p for p in head.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{'params': decay, 'weight_decay': args.weight_decay},
                                   {'params': rest, 'weight_decay': 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), fused=device.type == 'cuda')
    generator = torch.Generator(device='cpu').manual_seed(0)
    total, t_train, step, curve = args.steps, time.time(), 0, []
    head.train()
    while step < total:
        if step in (10, 20) and device.type == 'cuda':
            torch.cuda.synchronize(device)
        if step == 10:                  # the first steps compile and warm up: time the next ten
            t_ten = time.time()
        if step == 20:
            per_step = (time.time() - t_ten) / 10
            left = args.time_budget - (time.time() - t_train)
            total = max(21, min(args.steps, 20 + int(left / per_step)))
            print(f'{per_step:.3f} s/step -> {total} steps', flush=True)
        for group in optimizer.param_groups:
            group['lr'] = lr_at(step, total, args.lr, args.warmup)
        pick = torch.randint(len(train_ids), (args.batch_size,), generator=generator).to(device)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == 'cuda'):
            loss, parts = chain.loss(train_ids[pick], train_h[pick])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 100 == 0 or step in (1, total):
            curve.append(dict(step=step, loss=round(loss.item(), 4), parts=parts,
                              seconds=round(time.time() - t_train, 1)))
            print(curve[-1], flush=True)
    head.eval()
    after = chain.agreement(held_ids, held_h, args.batch_size)
    print(f'held-out agreement after: {after}', flush=True)
    os.makedirs(args.out, exist_ok=True)
    dtype = embed.dtype
    save_file({f'mtp.{n}': t.detach().to('cpu', dtype).contiguous()
               for n, t in head.state_dict().items()},
              os.path.join(args.out, 'mtp_head.safetensors'), metadata={'format': 'pt'})
    metrics = dict(args=vars(args), steps=step, step_weights=STEP_WEIGHTS[:args.depth],
                   train_windows=len(train_ids), held_windows=len(held_ids),
                   agreement_before=before, agreement_after=after, curve=curve,
                   seconds=round(time.time() - start, 1))
    with open(os.path.join(args.out, 'distill_metrics.json'), 'w') as f:
        json.dump(metrics, f, indent=1)
    print(f'saved {args.out} ({step} steps, {metrics["seconds"]} s)')


if __name__ == '__main__':
    main()
