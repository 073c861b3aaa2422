"""Single-process policy-gradient reference loop on the built-in tasks (no Ray).

Used to choose the default task, its size and the model size: the graph pipeline should do no
worse than this loop per sample. Prints mean score per step and the time to reach --target.

    python bench/pg_reference.py --task copy --num-digits 3 --algo ppo --max-seconds 120
    python bench/pg_reference.py --sampling-bench      # hand KV-cache loop vs model.generate

Algorithms (all with rl/ (masked, advantages, losses, kl, logprobs)):
  reinforce  A = score - batch mean, same for every token of a sequence
  grpo       A = grpo_advantages over groups of --group-size samples of one prompt
  ppo        critic (ValueModel) + GAE on per-token rewards (score on the last token, minus
             kl_coef * k1 KL to the initial policy), whitened advantages, clipped losses
--ppo-epochs / --num-minibatches > 1 make the updates off-policy within a step (clipping matters).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rl.algorithm.advantages import gae_advantages, grpo_advantages  # noqa: E402
from rl.algorithm.kl import kl_penalty, per_token_rewards  # noqa: E402
from rl.algorithm.losses import ppo_policy_loss, value_loss  # noqa: E402
from rl.algorithm.masked import masked_mean, masked_whiten  # noqa: E402
from rl.model import causal_lm as models, padded_batch  # noqa: E402
from rl.generation import hf_sampling  # noqa: E402
from rl.data import tasks  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--task", default=tasks.DEFAULT_TASK, choices=tasks.TASK_NAMES)
    p.add_argument("--num-digits", type=int, default=tasks.DEFAULT_NUM_DIGITS)
    p.add_argument("--algo", default="ppo", choices=("reinforce", "grpo", "ppo"))
    p.add_argument("--batch", type=int, default=256, help="samples per step")
    p.add_argument("--group-size", type=int, default=8, help="grpo: samples per prompt")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--critic-lr", type=float, default=None, help="default: --lr")
    p.add_argument("--ppo-epochs", type=int, default=1)
    p.add_argument("--num-minibatches", type=int, default=1)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--token-rewards", action="store_true",
                   help="reward each correct token (tasks.token_rewards) instead of the final score")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-seconds", type=float, default=120.0)
    p.add_argument("--max-steps", type=int, default=10_000)
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sampling-bench", action="store_true")
    return p.parse_args()


def sampling_bench(args):
    """Median time of the hand KV-cache loop vs model.generate (same model, full length)."""
    tok = tasks.build_tokenizer()
    model = models.build_policy({}, tok)
    task = tasks.make_task(args.task, args.num_digits, seed=0)
    num_new = 8
    for batch in (64, 128, 256):
        prompt_ids = [tok(r["prompt"])["input_ids"] for r in task.take(batch)]
        ids = torch.tensor(prompt_ids)
        gen_kwargs = dict(max_new_tokens=num_new, min_new_tokens=num_new, do_sample=True,
                          output_logits=True, return_dict_in_generate=True, top_k=None,
                          top_p=None, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        hand, hf = [], []
        for rep in range(12):
            t = time.perf_counter()
            hf_sampling.sample_responses(model, tok, prompt_ids, num_new, seed=rep)
            hand.append(time.perf_counter() - t)
            t = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **gen_kwargs)
            hf.append(time.perf_counter() - t)
        print(f"batch {batch} x {num_new} new tokens: hand loop {statistics.median(hand)*1e3:.1f} ms"
              f", model.generate {statistics.median(hf)*1e3:.1f} ms (median of 12)")


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.sampling_bench:
        return sampling_bench(args)
    torch.manual_seed(args.seed)
    tok = tasks.build_tokenizer()
    task = tasks.make_task(args.task, args.num_digits, seed=args.seed)
    model_config = models.ModelConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                                      intermediate_size=args.intermediate_size, seed=args.seed)
    policy = models.build_policy(model_config, tok)
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    critic = critic_opt = ref = None
    if args.algo == "ppo":
        critic = models.ValueModel.from_config(model_config, tok)
        critic_opt = torch.optim.Adam(critic.parameters(), lr=args.critic_lr or args.lr)
    if args.kl_coef > 0:
        ref = models.build_policy(model_config, tok).eval()
    prompts = task.prompts()
    gen = torch.Generator().manual_seed(args.seed)
    group = args.group_size if args.algo == "grpo" else 1
    print(f"# {vars(args)}  params={sum(p.numel() for p in policy.parameters())}")

    # Wall time suffers when other jobs share the 2 cores; process CPU time / threads is the
    # loaded-machine-independent estimate of the wall time on an idle machine.
    start, cpu_start, reached, history = time.perf_counter(), time.process_time(), None, []
    for step in range(args.max_steps):
        t0 = time.perf_counter()
        records = [r for r in (next(prompts) for _ in range(args.batch // group)) for _ in range(group)]
        prompt_ids = [tok(r["prompt"])["input_ids"] for r in records]
        samples = hf_sampling.sample_responses(policy, tok, prompt_ids, task.max_new_tokens,
                                          temperature=args.temperature, generator=gen)
        t_gen = time.perf_counter() - t0
        for r, s in zip(records, samples):
            s["score"] = task.score(r, tok.decode(s["response_ids"], skip_special_tokens=True))
            s["token_rewards"] = task.token_rewards(r, tok.convert_ids_to_tokens(s["response_ids"]))
        b = padded_batch.pad_batch(samples, tok.pad_token_id, token_keys=("logprobs", "token_rewards"))
        mask, scores = b["response_mask"], torch.tensor([s["score"] for s in samples])
        ids, attn = b["input_ids"], b["attention_mask"]

        with torch.no_grad():
            old_logprobs = b["logprobs"]
            kl = torch.zeros_like(mask)
            if ref is not None:
                ref_logprobs, _ = padded_batch.sequence_logprobs(ref, ids, attn, mask, with_entropy=False)
                kl = kl_penalty(old_logprobs, ref_logprobs, "k1") * mask
            if args.token_rewards:
                rewards = b["token_rewards"] - args.kl_coef * kl
            else:
                rewards = per_token_rewards(scores, kl, args.kl_coef, mask)
            if args.algo == "ppo":
                old_values = critic(ids, attn) * mask
                advantages, returns = gae_advantages(rewards, old_values, mask,
                                                             args.gamma, args.lam)
                advantages = masked_whiten(advantages, mask)
            elif args.algo == "grpo":
                advantages = grpo_advantages(rewards.sum(1), group_size=group)[:, None] * mask
            else:
                # reward-to-go minus the batch-mean return of the token's position
                to_go = rewards.flip(1).cumsum(1).flip(1)
                advantages = (to_go - masked_mean(to_go, mask, dim=0)[None]) * mask

        stats = {}
        num_mb = args.num_minibatches
        for _ in range(args.ppo_epochs):
            for mb in torch.randperm(len(samples), generator=gen).chunk(num_mb):
                logprobs, entropy = padded_batch.sequence_logprobs(policy, ids[mb], attn[mb], mask[mb])
                loss, stats = ppo_policy_loss(logprobs, old_logprobs[mb], advantages[mb],
                                                      mask[mb], args.clip_eps)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                opt.step()
                if critic is not None:
                    values = critic(ids[mb], attn[mb])
                    v_loss, _ = value_loss(values, old_values[mb], returns[mb], mask[mb],
                                                   clip_eps=0.2)
                    critic_opt.zero_grad()
                    v_loss.backward()
                    torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
                    critic_opt.step()

        elapsed = time.perf_counter() - start
        mean_score = scores.mean().item()
        history.append(mean_score)
        smooth = sum(history[-3:]) / len(history[-3:])
        if reached is None and smooth >= args.target:
            reached = (step, elapsed, (time.process_time() - cpu_start) / args.threads)
        print(f"step {step:4d} t={elapsed:6.1f}s cpu={(time.process_time() - cpu_start) / args.threads:6.1f}s score={mean_score:.3f} (3-step avg {smooth:.3f}) "
              f"len={mask.sum(1).mean():.2f} approx_kl={stats['approx_kl']:.4f} "
              f"gen={t_gen*1e3:.0f}ms step={(time.perf_counter()-t0)*1e3:.0f}ms", flush=True)
        if elapsed > args.max_seconds or (reached is not None and smooth >= 0.95):
            break
    if reached is None:
        cpu = (time.process_time() - cpu_start) / args.threads
        print(f"RESULT not reached {args.target} in {step + 1} steps, {elapsed:.1f}s wall, "
              f"{cpu:.1f}s cpu/threads; final 3-step avg {smooth:.3f}")
    else:
        print(f"RESULT reached {args.target} (3-step avg) at step {reached[0]} after "
              f"{reached[1]:.1f}s wall, {reached[2]:.1f}s cpu/threads, "
              f"{(reached[0] + 1) * args.batch} samples; final {smooth:.3f}")


if __name__ == "__main__":
    main()
