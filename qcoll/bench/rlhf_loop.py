"""One RLHF iteration shaped like DeepSpeed-Chat's step 3 (PPO on the actor), for any causal LM.

The parts, each a function of plain models so that a sharded run and a one-process oracle
share them (``qcoll-bench rlhf`` times them; tests/test_bench_rlhf.py checks the sharding):

- :func:`rollout`: the actor samples ``tokens`` new tokens per prompt with Hugging Face
  ``generate`` (``do_sample``, temperature 1, no top-k or top-p), seeded right before;
- :func:`reward_of`: the programmatic reward, the share of response tokens whose id is even
  (a random policy scores about 0.5; 1.0 is the best);
- :func:`score`: the actor's and the frozen reference's log-probabilities of the response
  (no gradient), DeepSpeed-Chat's per-token reward ``-kl_coef x (logp - ref_logp)`` with the
  sequence reward added at the last token, its reward-to-go, and advantages against the
  batch mean of the return at each position (no critic: a value head is optional in the
  issue, and the batch-mean baseline needs no extra model);
- :func:`ppo_loss`: PPO's clipped policy-gradient loss over the response tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Experience:
    """One rank's batch of rollouts. Shapes: ``B`` prompts, ``P`` prompt tokens, ``T`` response tokens."""

    sequences: torch.Tensor   # [B, P + T] int64: prompt and response
    prompt_len: int           # P
    reward: torch.Tensor      # [B] fp32: the programmatic reward of each response
    old_logp: torch.Tensor    # [B, T] fp32: the actor's log-probabilities when it generated them
    ref_logp: torch.Tensor    # [B, T] fp32: the reference's
    advantages: torch.Tensor  # [B, T] fp32


def rollout(actor, prompts: torch.Tensor, tokens: int, seed: int) -> torch.Tensor:
    """``[B, P + tokens]`` int64: ``prompts`` (``[B, P]``) and ``tokens`` sampled new tokens each."""
    torch.manual_seed(seed)
    return actor.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=tokens,
                          min_new_tokens=tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)


def reward_of(responses: torch.Tensor) -> torch.Tensor:
    """``[B]`` fp32: the share of each response's tokens (``[B, T]``) whose id is even."""
    return (responses % 2 == 0).float().mean(dim=1)


def response_logp(model, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """``[B, T]`` fp32: log-probability of each response token under ``model`` (with the
    gradient when it is enabled)."""
    logits = model(sequences, attention_mask=torch.ones_like(sequences)).logits[:, prompt_len - 1:-1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, sequences[:, prompt_len:, None]).squeeze(-1)


def score(actor, ref, sequences: torch.Tensor, prompt_len: int, kl_coef: float, actor_scope=None) -> Experience:
    """The experience of ``sequences``: rewards, both models' log-probabilities, advantages.
    ``actor_scope``: a context for the actor's forward (e.g. its ``generation_mode``)."""
    with torch.no_grad():
        if actor_scope is not None:
            with actor_scope:
                old = response_logp(actor, sequences, prompt_len)
        else:
            old = response_logp(actor, sequences, prompt_len)
        ref_logp = response_logp(ref, sequences, prompt_len)
        reward = reward_of(sequences[:, prompt_len:])
        per_token = -kl_coef * (old - ref_logp)
        per_token[:, -1] += reward
        returns = per_token.flip(1).cumsum(1).flip(1)
        advantages = returns - returns.mean(dim=0, keepdim=True)
    return Experience(sequences, prompt_len, reward, old, ref_logp, advantages)


def ppo_loss(actor, exp: Experience, clip: float) -> torch.Tensor:
    """PPO's clipped surrogate, averaged over the batch's response tokens (a scalar with grad)."""
    logp = response_logp(actor, exp.sequences, exp.prompt_len)
    ratio = torch.exp(logp - exp.old_logp)
    surrogate = torch.minimum(ratio * exp.advantages, ratio.clamp(1.0 - clip, 1.0 + clip) * exp.advantages)
    return -surrogate.mean()


def prompts_for(seed: int, iteration: int, rank: int, batch: int, length: int, vocab: int) -> torch.Tensor:
    """``[batch, length]`` int64: rank ``rank``'s prompts of ``iteration`` (ids 2.. vocab-1)."""
    gen = torch.Generator().manual_seed(_mix(seed, iteration, rank, 1))
    return torch.randint(2, vocab, (batch, length), generator=gen)


def sample_seed(seed: int, iteration: int, rank: int) -> int:
    """The sampling seed of rank ``rank``'s rollouts in ``iteration``."""
    return _mix(seed, iteration, rank, 2)


def _mix(*values: int) -> int:
    h = 0
    for v in values:
        h = (h * 1_000_003 + v + 1) % (2 ** 62)
    return h
