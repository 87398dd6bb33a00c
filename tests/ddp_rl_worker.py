"""Policy-gradient updates of a tiny GPT per case, run by tests/test_distributed_rl.py as 1 process or under torchrun.

    python tests/ddp_rl_worker.py OUT [CASE ...]
    torchrun --standalone --nproc_per_node=2 tests/ddp_rl_worker.py OUT [CASE ...]

The update cases sample every rollout once, up front, from the starting policy with one seeded generator, so every
process holds the same global batches; each rank then updates on its share (`shard_rollout`) and the per-step
metrics must be the one process's. The "learn" case samples live: each rank its own prompt with its own generator,
and the probability of the rewarded tokens must rise. Rank 0 writes OUT/<case>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llm_from_scratch import distributed  # noqa: E402
from llm_from_scratch.model import GPT, GPTConfig, eval_mode  # noqa: E402
from llm_from_scratch.policy_gradient import MovingAverageBaseline, PGConfig, pg_update, rollout, shard_rollout  # noqa: E402,E501
from llm_from_scratch.ppo import AdaptiveKLController, PolicyValue, PPOConfig, actor, make_optimizer, ppo_step  # noqa: E402,E501
from llm_from_scratch.reward_model import RewardModel  # noqa: E402
from llm_from_scratch.tokenizer import Tokenizer, encode_chat  # noqa: E402

TEXT = "Add 2 and 3. 5 Sort these words: cat, dog. cat, dog Once upon a time there was a kite. The end. " * 30
PROMPTS = ["Add 2 and 3.", "Sort these words: cat, dog.", "Once upon a time", "Add 4 and 1.", "The end."]  # 3 : 2
CASES = {  # name: the update's settings (k = 4 samples per prompt, 5 prompts: the ranks hold 3 and 2 groups)
    "rloo": dict(algo="rloo", beta=0.05),
    "grpo_kl_loss": dict(algo="grpo", inner_epochs=2, kl_in="loss", beta=0.05),
    "dapo_filtered": dict(algo="rloo", loss_type="dapo", filter_groups=True, beta=0.02),
    "reinforce_baseline": dict(algo="reinforce-baseline", beta=0.0),
    # rank 1's two prompts always score 1: the filter drops all of its rows, and it must still join DDP's all-reduce
    "filter_idle_rank": dict(algo="grpo", loss_type="dapo", filter_groups=True, inner_epochs=2, beta=0.02),
}
RANK_1_PROMPTS = PROMPTS[3:]
PPO_CASES = ("ppo_shared_critic", "ppo_separate_critic")  # one minibatch per epoch: the one-process batch exactly


def tiny_gpt(tok: Tokenizer) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=64, n_layer=1, n_head=2, n_embd=32))


def length_reward(prompts: list[str], completions: list[str]) -> list[float]:
    return [float(len(c) % 3 == 0) for c in completions]  # some groups all equal: the filter has work


def idle_reward(prompts: list[str], completions: list[str]) -> list[float]:
    return [1.0 if p in RANK_1_PROMPTS else r for p, r in zip(prompts, length_reward(prompts, completions))]


def update_case(tok: Tokenizer, name: str, device) -> dict:
    policy, reference = tiny_gpt(tok).to(device), tiny_gpt(tok).to(device)
    cfg = PGConfig(k=4, max_new_tokens=6, **CASES[name])
    g = torch.Generator().manual_seed(0)  # the same on every rank: the same global rollouts
    reward = idle_reward if name == "filter_idle_rank" else length_reward
    batches = [rollout(policy, reference, tok, PROMPTS, 4, reward, max_new_tokens=6, generator=g) for _ in range(4)]
    forward = distributed.wrap(policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.0)
    baseline = MovingAverageBaseline()
    steps = [pg_update(forward, optimizer, shard_rollout(ro), cfg, baseline) for ro in batches]
    return {"steps": steps, "checksum": sum(float(p.detach().double().sum()) for p in policy.parameters())}


def ppo_case(tok: Tokenizer, name: str, device) -> dict:
    """Two PPO iterations (2 epochs of 1 minibatch each) with the adaptive KL controller, on the shared critic (a
    value head on the policy) or a separate one (a reward-model-shaped trunk and head)."""
    reference = tiny_gpt(tok).to(device)
    if name == "ppo_shared_critic":
        policy, critic = PolicyValue(tiny_gpt(tok)).to(device), None
    else:
        policy, critic = tiny_gpt(tok).to(device), RewardModel(tiny_gpt(tok)).to(device)
    g = torch.Generator().manual_seed(0)  # the same global rollouts on every rank
    batches = [rollout(actor(policy), reference, tok, PROMPTS, 4, length_reward, max_new_tokens=6, generator=g)
               for _ in range(2)]
    optimizer = make_optimizer(policy, critic, lr=1e-2, critic_lr=1e-2)
    forward, forward_critic = distributed.wrap(policy), distributed.wrap(critic) if critic is not None else None
    kl_ctl = AdaptiveKLController(0.05, target=0.01, horizon=50)  # far from the target: the coefficient moves
    cfg = PPOConfig(epochs=2, minibatches=1, whiten_rewards=True)
    steps = [ppo_step(forward, forward_critic, optimizer, shard_rollout(ro), kl_ctl, cfg,
                      torch.Generator().manual_seed(1)) for ro in batches]
    models = [policy] + ([critic] if critic is not None else [])
    return {"steps": steps, "kl_coef": kl_ctl.value,
            "checksum": sum(float(p.detach().double().sum()) for model in models for p in model.parameters())}


def learn_case(tok: Tokenizer, device) -> dict:
    """Reward 1 when the one-token completion starts with a space; each rank samples its own prompt."""
    policy, reference = tiny_gpt(tok).to(device), tiny_gpt(tok).to(device)
    prompts = ["Sort these words: cat, dog.", "Add 2 and 3."]
    mine = prompts[distributed.shard_rows(len(prompts))]
    spaced = torch.tensor([tok.decode([i]).startswith(" ") for i in range(tok.vocab_size)])  # (V,)

    def p_rewarded() -> float:  # over both prompts, the same on every rank (identical weights)
        with eval_mode(policy), torch.no_grad():
            return sum(torch.softmax(policy(torch.tensor([encode_chat(tok, p)[0]]))[0, -1], -1)[spaced].sum().item()
                       for p in prompts) / len(prompts)

    before = p_rewarded()
    forward = distributed.wrap(policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=2e-2, weight_decay=0.0)
    cfg = PGConfig(algo="rloo", k=16, beta=0.0, max_new_tokens=1)
    g = torch.Generator().manual_seed(100 + distributed.rank())  # each rank its own samples
    for _ in range(15):
        ro = rollout(policy, reference, tok, mine, 16, max_new_tokens=1, generator=g,
                     reward_fn=lambda p, c: [float(x.startswith(" ")) for x in c])
        pg_update(forward, optimizer, ro, cfg)
    return {"before": before, "after": p_rewarded(),
            "checksum": sum(float(p.detach().double().sum()) for p in policy.parameters())}


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2:] or [*CASES, *PPO_CASES, "learn"]
    device = distributed.setup("cpu")
    tok = Tokenizer.train(TEXT, 300)  # deterministic: the same tokenizer in every process
    out.mkdir(parents=True, exist_ok=True)
    for name in cases:
        result = (learn_case(tok, device) if name == "learn" else ppo_case(tok, name, device) if name in PPO_CASES
                  else update_case(tok, name, device))
        checksums = distributed.all_gather_objects(result.pop("checksum"))
        if distributed.is_main():
            (out / f"{name}.json").write_text(json.dumps({**result, "world_size": distributed.world_size(),
                                                          "checksums": checksums}))
    distributed.cleanup()


if __name__ == "__main__":
    main()
