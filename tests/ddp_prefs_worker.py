"""A few steps of the reward model (chapter 6) and of DPO (chapter 9) on tiny models, run by
tests/test_distributed_prefs.py as one process or under torchrun.

    python tests/ddp_prefs_worker.py OUT [CASE ...]
    torchrun --standalone --nproc_per_node=2 tests/ddp_prefs_worker.py OUT [CASE ...]

"reward": reward_model.train_reward_model on batches of 5 pairs (3 and 2 under 2 processes), 5 held-out pairs; it
writes OUT/reward/metrics.jsonl itself. "dpo" (5 pairs a step, DPO with label smoothing) and "dpo_ipo" (4 pairs, IPO):
dpo.dpo_step on a DDP-wrapped policy (and once, first, on the bare policy, which it must refuse under torchrun).
Rank 0 then writes OUT/<case>/ranks.json: every rank's checksum of its final weights and what every rank returned (the
DPO metrics of each step; the reward model's best evaluation).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llm_from_scratch import distributed  # noqa: E402
from llm_from_scratch.dpo import DPOConfig, dpo_step, preference_batch, reference_logps  # noqa: E402
from llm_from_scratch.model import GPT, GPTConfig  # noqa: E402
from llm_from_scratch.reward_model import RewardConfig, RewardModel, encode_pairs, train_reward_model  # noqa: E402
from llm_from_scratch.tokenizer import Tokenizer  # noqa: E402

TEXT = "Add 2 and 3. 5 Sort these words: cat, dog. cat, dog Once upon a time there was a kite. The end. " * 30
WORDS = "Add 2 and 3 5 Sort these words cat dog Once upon a time there was kite The end".split()
STEPS, T = 6, 64
CASES = {  # name: (pairs per step, DPOConfig); the reward model's case has no DPOConfig
    "reward": (5, None),
    "dpo": (5, DPOConfig(beta=0.5, label_smoothing=0.1)),
    "dpo_ipo": (4, DPOConfig(beta=0.5, loss_type="ipo")),
}


def synthetic_pairs(n: int, seed: int) -> list[dict]:
    """n pairs {"prompt", "chosen", "rejected"} of random words, the chosen response always the longer one (so there
    is something to learn), each response 1 to 12 words: rows of unequal lengths, padded."""
    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    pairs = []
    for _ in range(n):
        short = rng.randint(1, 5)
        pairs.append({"prompt": say(rng.randint(2, 5)) + ".", "chosen": say(short + rng.randint(1, 7)),
                      "rejected": say(short)})
    return pairs


def tiny_gpt(tok: Tokenizer, seed: int, device) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=T, n_layer=2, n_head=2, n_embd=32,
                         dropout=0.0)).to(device)


def checksum(model: torch.nn.Module) -> float:
    return sum(float(p.detach().double().sum()) for p in model.parameters())


def reward_case(tok: Tokenizer, out: Path, device) -> dict:
    rm = RewardModel(tiny_gpt(tok, 0, device)).to(device)
    train_pairs = encode_pairs(tok, synthetic_pairs(40, seed=1), T)
    val_pairs = encode_pairs(tok, synthetic_pairs(5, seed=2), T)  # 5: shared 3 and 2 between 2 ranks
    cfg = RewardConfig(max_steps=STEPS, batch_size=CASES["reward"][0], lr=3e-3, min_lr=1e-3, warmup_steps=1,
                       eval_interval=3, log_interval=1, chunk_rows=4)  # rank 0's 6 rows: 2 forward passes, rank 1's: 1
    best = train_reward_model(rm, train_pairs, val_pairs, cfg, tok.pad_id, out, quiet=True)
    best.pop("seconds")
    return {"checksum": checksum(rm), "returned": best}


def dpo_case(case: str, tok: Tokenizer, device) -> dict:
    n_pairs, cfg = CASES[case]
    train = synthetic_pairs(n_pairs * STEPS, seed=3)
    ref = reference_logps(tiny_gpt(tok, 1, device), tok, train)  # (N, 2): another model, so h ≠ 0 at the first step
    policy = tiny_gpt(tok, 0, device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3, weight_decay=0.0)
    forward = distributed.wrap(policy)  # DDP under torchrun
    refused = False  # under torchrun, the policy itself (not DDP's wrapper) is refused before anything happens
    if distributed.world_size() > 1:
        try:
            batch = preference_batch(tok, train[:n_pairs])
            dpo_step(policy, optimizer, batch, ref[:n_pairs, 0], ref[:n_pairs, 1], cfg)
        except ValueError as e:
            refused = "distributed.wrap" in str(e)
    history = []
    for step in range(STEPS):
        idx = torch.arange(step * n_pairs, (step + 1) * n_pairs)  # (N,) a new global batch each step
        batch = tuple(t.to(device) for t in preference_batch(tok, [train[i] for i in idx.tolist()]))
        history.append(dpo_step(forward, optimizer, batch, ref[idx, 0].to(device), ref[idx, 1].to(device), cfg))
    return {"checksum": checksum(policy), "returned": history, "refused": refused}


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2:] or list(CASES)
    device = distributed.setup("cpu")
    tok = Tokenizer.train(TEXT, 300)  # deterministic: the same tokenizer in every process
    for case in cases:
        (out / case).mkdir(parents=True, exist_ok=True)
        result = reward_case(tok, out / case, device) if case == "reward" else dpo_case(case, tok, device)
        ranks = distributed.all_gather_objects(result)
        if distributed.is_main():
            (out / case / "ranks.json").write_text(json.dumps({"world_size": distributed.world_size(),
                                                               "checksums": [r["checksum"] for r in ranks],
                                                               "returned": [r["returned"] for r in ranks],
                                                               "refused": [r.get("refused") for r in ranks]}))
    distributed.cleanup()


if __name__ == "__main__":
    main()
