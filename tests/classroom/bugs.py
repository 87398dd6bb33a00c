"""A catalogue of typical wrong implementations: for every function the classroom kit hands out, the bugs students
actually write, each as a small edit of the reference (old text -> new text, inside that function).

tests/classroom/test_kit.py builds each assignment, plants each bug in the reference, and checks that the grader
fails it. A bug the grader cannot see is a missing test in the project's own suite: add the test, not an exception.
"""

BUGS: dict[str, list[tuple[str, str, str]]] = {
    # ---------------------------------------------------------------- chapter 1
    "tokenizer.merge_pair": [
        ("merges only the first occurrence",
         "            out.append(new_id)\n            i += 2",
         "            out.append(new_id)\n            return out + ids[i + 2:]"),
        ("skips only one token after a merge (the pair's second token stays)",
         "            i += 2", "            i += 1"),
        ("drops the last token of a chunk", "while i < len(ids):", "while i < len(ids) - 1:"),
        ("matches the pair in either order",
         "ids[i] == pair[0] and ids[i + 1] == pair[1]", "{ids[i], ids[i + 1]} == set(pair)"),
    ],
    "tokenizer.learn_merges_naive": [
        ("counts pairs across chunk boundaries",
         "        for ids in chunks:\n            counts.update(zip(ids, ids[1:]))",
         "        flat = [t for ids in chunks for t in ids]\n        counts.update(zip(flat, flat[1:]))"),
        ("breaks ties by the largest pair", "neg_count, pair = min(candidates)",
         "neg_count, pair = min(candidates, key=lambda c: (c[0], [-t for t in c[1]]))"),
        ("counts a pair once per chunk, however often it occurs there",
         "counts.update(zip(ids, ids[1:]))", "counts.update(set(zip(ids, ids[1:])))"),
        ("records the count with the wrong sign", "merges.append((pair, -neg_count))", "merges.append((pair, neg_count))"),
    ],
    "data.TokenWindowDataset.__getitem__": [
        ("targets not shifted by one", "return window[:-1], window[1:]", "return window[:-1], window[:-1]"),
        ("windows one token short", "start + self.context_length + 1]", "start + self.context_length]"),
        ("ignores the stride", "start = (i % len(self)) * self.stride", "start = i % len(self)"),
    ],
    "data.sft_collate": [
        ("the prompt left in the loss", "y[i, : n_prompt - 1] = -100", "pass"),
        ("prompt mask off by one (hides the answer's first token)", "y[i, : n_prompt - 1] = -100", "y[i, :n_prompt] = -100"),
        ("targets not shifted", "y[i, :n] = ids[1:]", "y[i, :n] = ids[:-1]"),
        ("padding scored (targets padded with pad_id, not -100)",
         "y = torch.full((len(examples), T), -100, dtype=torch.long)",
         "y = torch.full((len(examples), T), pad_id, dtype=torch.long)"),
    ],
    # ---------------------------------------------------------------- chapter 2
    "attention.causal_mask": [
        ("ignores the cached positions (square mask)", ".tril(diagonal=S - T)", ".tril()"),
        ("each position cannot see itself", ".tril(diagonal=S - T)", ".tril(diagonal=S - T - 1)"),
        ("upper triangle (sees the future, not the past)", ".tril(diagonal=S - T)", ".triu(diagonal=S - T)"),
    ],
    "attention.explicit_attention": [
        ("missing 1/sqrt(d)", " * (1.0 / math.sqrt(q.size(-1)))", ""),
        ("scaled by 1/d instead of 1/sqrt(d)", "(1.0 / math.sqrt(q.size(-1)))", "(1.0 / q.size(-1))"),
        ("softmax over the queries", "F.softmax(scores, dim=-1)", "F.softmax(scores, dim=-2)"),
        ("mask applied the wrong way round", "scores.masked_fill(~mask,", "scores.masked_fill(mask,"),
        ("masked with 0 instead of -inf", 'masked_fill(~mask, float("-inf"))', "masked_fill(~mask, 0.0)"),
    ],
    "attention.CausalSelfAttention.forward": [
        ("heads split without the transpose (view as (B, H, T, D) directly)",
         "q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)",
         "q = q.reshape(B, self.n_head, T, self.head_dim)"),
        ("heads joined without transposing back", "y = y.transpose(1, 2).contiguous().view(B, T, C)",
         "y = y.contiguous().view(B, T, C)"),
        ("output projection forgotten", "return self.resid_dropout(self.c_proj(y))", "return self.resid_dropout(y)"),
        ("queries and keys swapped in the split", "q, k, v = self.c_attn(x).split(C, dim=2)",
         "k, q, v = self.c_attn(x).split(C, dim=2)"),
        ("the cache is never read", "k, v = kv_cache.update(self.layer_idx, k, v)",
         "kv_cache.update(self.layer_idx, k, v)"),
    ],
    "attention.KVCache.update": [
        ("overwrites position 0 instead of appending", "self.k[layer, :, :, self.length:end] = k_new",
         "self.k[layer, :, :, :k_new.size(2)] = k_new"),
        ("returns only the new keys and values", "return self.k[layer, :, :, :end], self.v[layer, :, :, :end]",
         "return k_new, v_new"),
        ("returns the whole buffer, empty slots included", "return self.k[layer, :, :, :end], self.v[layer, :, :, :end]",
         "return self.k[layer], self.v[layer]"),
    ],
    # ---------------------------------------------------------------- chapter 3
    "model.Block.forward": [
        ("post-norm (the original Transformer) instead of GPT-2's pre-norm",
         "x = x + self.attn(self.ln_1(x), mask, kv_cache)", "x = self.ln_1(x + self.attn(x, mask, kv_cache))"),
        ("no residual around the MLP", "x = x + self.mlp(self.ln_2(x))", "x = self.mlp(self.ln_2(x))"),
        ("the MLP reads the block's input, not the attention's output (parallel block)",
         "        x = x + self.attn(self.ln_1(x), mask, kv_cache)\n        x = x + self.mlp(self.ln_2(x))",
         "        x = x + self.attn(self.ln_1(x), mask, kv_cache) + self.mlp(self.ln_2(x))"),
        ("LayerNorms swapped", "self.attn(self.ln_1(x), mask, kv_cache)", "self.attn(self.ln_2(x), mask, kv_cache)"),
    ],
    "generation.filter_logits": [
        ("nucleus drops the token that crosses p", "mass_before = probs.cumsum(dim=-1) - probs",
         "mass_before = probs.cumsum(dim=-1)"),
        ("nucleus kept in sorted order (the mask lands on the wrong tokens)",
         "drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)", "drop = drop_sorted"),
        ("top-k keeps k - 1 tokens", "logits.masked_fill(logits < kth,", "logits.masked_fill(logits <= kth,"),
        ("nucleus keeps the tail instead of the head", "torch.sort(logits, dim=-1, descending=True)",
         "torch.sort(logits, dim=-1)"),
    ],
    "generation.token_logprobs": [
        ("log-softmax over the wrong axis",
         "torch.logsumexp(logits, dim=-1)", "torch.logsumexp(logits, dim=-2)"),
        ("returns the logit, not the log-probability",
         " - torch.logsumexp(logits, dim=-1)", ""),
        ("unstable: log of softmax", "return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)",
         "return torch.log(torch.softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1))"),
    ],
    "generation.sequence_logprobs": [
        ("log-probs not shifted: the target is the token itself", "token_logprobs(logits.float() / temperature, ids[:, 1:])",
         "token_logprobs(logits.float() / temperature, ids[:, :-1])"),
        ("temperature ignored", "token_logprobs(logits.float() / temperature,", "token_logprobs(logits.float(),"),
        ("padding not zeroed", "logp = logp * (attention_mask[:, 1:] * attention_mask[:, :-1]).to(logp.dtype)", "pass"),
        ("attention mask not passed to the model",
         "logits = model(ids, attention_mask=None if all_real else attention_mask)[:, :-1]",
         "logits = model(ids)[:, :-1]"),
        ("a row's first real token kept (it has no prefix)",
         "(attention_mask[:, 1:] * attention_mask[:, :-1])", "(attention_mask[:, 1:])"),
    ],
    # ---------------------------------------------------------------- chapter 4
    "train.lr_at": [
        ("warmup starts at step 1's rate one step late", "cfg.lr * (step + 1) / cfg.warmup_steps",
         "cfg.lr * step / cfg.warmup_steps"),
        ("cosine decays to 0, not to min_lr", "return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5",
         "return cfg.lr * 0.5"),
        ("progress counted from step 0, not from the end of warmup",
         "progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)",
         "progress = step / max(1, cfg.max_steps)"),
    ],
    "train.lm_loss": [
        ("no log-softmax: the negative logit of the target, not its log-probability",
         "F.cross_entropy(logits.flatten(0, 1).float(),", "F.nll_loss(logits.flatten(0, 1).float(),"),
        ("summed instead of averaged", "ignore_index=-100)", "ignore_index=-100, reduction=\"sum\")"),
        ("shifts again what the batch already shifted",
         "F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100)",
         "F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), y[:, 1:].flatten(), ignore_index=-100)"),
    ],
    "train.accumulate_gradients": [
        ("loss not divided by the number of micro-batches", "(loss / K).backward()", "loss.backward()"),
        ("gradients zeroed before each micro-batch", "        (loss / K).backward()",
         "        model.zero_grad()\n        (loss / K).backward()"),
        ("returns the last micro-batch's loss", "return loss_sum / K, tokens", "return loss.item(), tokens"),
        ("counts every position as a target", "tokens += int((y != -100).sum())", "tokens += y.numel()"),
    ],
    # ---------------------------------------------------------------- chapter 6
    "reward_model.RewardModel.forward": [
        ("the reward read at the last column, whatever the padding", "h_last = h[torch.arange(ids.size(0), device=ids.device), last]",
         "h_last = h[:, -1]"),
        ("the reward read at the first real token",
         "(attention_mask.bool() * torch.arange(1, T + 1, device=ids.device)).argmax(-1)",
         "attention_mask.long().argmax(-1)"),
        ("the last real token found as the count of real tokens (right padding only)",
         "(attention_mask.bool() * torch.arange(1, T + 1, device=ids.device)).argmax(-1)",
         "attention_mask.sum(-1) - 1"),
        ("attention mask not passed to the trunk", "h = self.gpt.trunk(ids, attention_mask)", "h = self.gpt.trunk(ids)"),
    ],
    "reward_model.bradley_terry_loss": [
        ("sign flipped", "-F.logsigmoid(chosen_rewards - rejected_rewards)", "-F.logsigmoid(rejected_rewards - chosen_rewards)"),
        ("sigmoid without the log", "-F.logsigmoid(chosen_rewards - rejected_rewards).mean()",
         "-torch.sigmoid(chosen_rewards - rejected_rewards).mean()"),
        ("summed instead of averaged", ".mean()", ".sum()"),
    ],
    # ---------------------------------------------------------------- chapter 7
    "policy_gradient.masked_mean": [
        ("divides by every position, padding included", "return masked_sum(x, mask, dim) / count.clamp(min=1)",
         "return masked_sum(x, mask, dim) / (mask.numel() if dim is None else mask.size(dim))"),
        ("averages without the mask", "return masked_sum(x, mask, dim) / count.clamp(min=1)",
         "return x.mean() if dim is None else x.mean(dim)"),
        ("an empty row divides by zero", "count.clamp(min=1)", "count"),
    ],
    "policy_gradient.kl_k3": [
        ("the sign of d flipped", "return torch.expm1(-d) + d", "return torch.expm1(d) - d"),
        ("k2 instead of k3", "return torch.expm1(-d) + d", "return 0.5 * d ** 2"),
        ("k1 instead of k3", "return torch.expm1(-d) + d", "return d"),
    ],
    "policy_gradient.rloo_advantages": [
        ("the baseline includes the sample itself", "others = (r.sum(dim=1, keepdim=True) - r) / (k - 1)",
         "others = r.mean(dim=1, keepdim=True)"),
        ("divides by k instead of k - 1", "/ (k - 1)", "/ k"),
        ("groups strided instead of consecutive", "r = rewards.view(-1, k)", "r = rewards.view(k, -1).t()"),
    ],
    "policy_gradient.grpo_advantages": [
        ("not centred", "adv = r - r.mean(dim=1, keepdim=True)", "adv = r"),
        ("the batch's std instead of the group's", "adv = adv / (r.std(dim=1, keepdim=True) + eps)",
         "adv = adv / (r.std() + eps)"),
        ("the batch's mean instead of the group's", "adv = r - r.mean(dim=1, keepdim=True)", "adv = r - r.mean()"),
        ("scale='none' still divides", 'if scale == "group":', "if True:"),
    ],
    "policy_gradient.clipped_policy_loss": [
        ("max instead of min (pessimism turned to optimism)", "-torch.minimum(unclipped, clipped)",
         "-torch.maximum(unclipped, clipped)"),
        ("the ratio inverted", "torch.exp(logp - old_logp.detach())", "torch.exp(old_logp.detach() - logp)"),
        ("only the clipped term", "-torch.minimum(unclipped, clipped)", "-clipped"),
        ("the loss's sign flipped", "aggregate(-torch.minimum(unclipped, clipped),", "aggregate(torch.minimum(unclipped, clipped),"),
    ],
    # ---------------------------------------------------------------- chapter 8
    "ppo.per_token_rewards": [
        ("the score on the first token", "rewards[rows, last_token_index(mask)] += scores.to(rewards)",
         "rewards[rows, mask.long().argmax(1)] += scores.to(rewards)"),
        ("the score on the last column, padding or not", "rewards[rows, last_token_index(mask)]", "rewards[rows, -1]"),
        ("the KL penalty's sign flipped", "rewards = -kl_coef * (logp - ref_logp)", "rewards = kl_coef * (logp - ref_logp)"),
        ("the KL penalty charged on padding too", " * mask.to(logp.dtype)  # (B, T)", "  # (B, T)"),
    ],
    "ppo.compute_gae": [
        ("left to right", "for t in reversed(range(values.size(1))):", "for t in range(values.size(1)):"),
        ("lambda forgotten", "gamma * lam * next_advantage", "gamma * next_advantage"),
        ("returns without the values", "returns = (advantages + values) * mask", "returns = advantages * mask"),
        ("padding does not reset the recursion", "next_advantage = (delta + gamma * lam * next_advantage) * mask[:, t]",
         "next_advantage = delta + gamma * lam * next_advantage"),
    ],
    # ---------------------------------------------------------------- chapter 9
    "dpo.dpo_loss": [
        ("sign flipped", "h = chosen_ratio - rejected_ratio", "h = rejected_ratio - chosen_ratio"),
        ("beta forgotten inside the sigmoid", "F.logsigmoid(beta * h)", "F.logsigmoid(h)"),
        ("reference log-probs added, not subtracted", "chosen_ratio = policy_chosen_logps - ref_chosen_logps.detach()",
         "chosen_ratio = policy_chosen_logps + ref_chosen_logps.detach()"),
        ("IPO's target margin 1/beta instead of 1/(2 beta)", "(h - 1 / (2 * beta)) ** 2", "(h - 1 / beta) ** 2"),
        ("label smoothing weights swapped", "-(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)",
         "-label_smoothing * F.logsigmoid(beta * h) - (1 - label_smoothing) * F.logsigmoid(-beta * h)"),
    ],
    # ---------------------------------------------------------------- chapter 10
    "arena.best_of_n_expected": [
        ("ranked from the highest proxy to the lowest", "ranked @ best_of_n_weights(m, n)",
         "ranked.flip(1) @ best_of_n_weights(m, n)"),
        ("ties go to the last drawn", "order = (m - 1) - torch.argsort(proxy.double().flip(1), dim=1, stable=True)",
         "order = torch.argsort(proxy.double(), dim=1, stable=True)"),
        ("ranks by the values, not by the proxy", "torch.argsort(proxy.double().flip(1)", "torch.argsort(values.double().flip(1)"),
    ],
    "arena.keep_top": [
        ("keeps the lowest scores", "torch.argsort(-scores.double(), dim=1, stable=True)",
         "torch.argsort(scores.double(), dim=1, stable=True)"),
        ("rounds down", "keep = max(1, round(fraction * k))", "keep = max(1, int(fraction * k))"),
        ("keeps none when the fraction rounds to 0", "keep = max(1, round(fraction * k))", "keep = round(fraction * k)"),
    ],
}
BUGS["data.WindowSampler.batch"] = [
    ("targets not shifted by one", "return windows[:, :-1], windows[:, 1:]", "return windows[:, :-1], windows[:, :-1]"),
    ("windows of T tokens (the last target is the next window's)", "offsets = torch.arange(self.context_length + 1)",
     "offsets = torch.arange(self.context_length)"),
    ("the last window that fits is never drawn", "len(self.tokens) - self.context_length,",
     "len(self.tokens) - self.context_length - 1,"),
    ("the same batch at every step", "manual_seed(self.seed * 1_000_003 + step)", "manual_seed(self.seed)"),
]
