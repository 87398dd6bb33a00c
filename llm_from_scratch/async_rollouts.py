"""Rollouts that overlap training: a worker process samples the next batch while the trainer updates (appendix B).

A synchronous RL step samples a batch with the weights θ_t, then updates them to θ_{t+1}: the sampler waits for the
update and the update for the sampler. One step off-policy (as verl and OpenRLHF offer), a second process samples
batch t+1 with θ_t while the trainer's update on batch t runs:

    trainer:   update on batch 0 (θ0 → θ1)   update on batch 1 (θ1 → θ2)   update on batch 2 (θ2 → θ3)  ...
    worker:    sample batch 1 with θ0        sample batch 2 with θ1        sample batch 3 with θ2       ...

(batch 0 is sampled with θ0 before the first update), so batch t ≥ 1 was drawn by μ = π_{θ_{t−1}} and updates π at
θ_t: one update stale. A step then costs max(sampling, update) instead of their sum.

The estimator (policy_gradient.truncated_is_weights; `pg_update` and `ppo.ppo_step` apply it when a Rollout carries
the sampler's log-probs, `behaviour_logp`). Let π_old be the policy as the update starts (θ_t; its log-probs give the
KL, the advantages and PPO's clipping anchor). Each token's loss term is multiplied by the constant

    w_t = min(π_old(y_t | x, y_<t) / μ(y_t | x, y_<t), C)          (C = --is-cap, default 2)

so E_μ[w_t · A ∇log π(y_t)] = E_π_old[A ∇log π(y_t)] token by token wherever the ratio is below C. Its bias:

* per token, not per sequence: the exact correction of a sequence's probability is the product Π_t π_old/μ over its
  tokens (and of the state distribution the earlier tokens lead to); using each token's own ratio ignores how μ and
  π_old differ on the prefix. The product's variance grows with the length, the per-token weight's does not: this is
  the usual trade (PPO's ratio is per token for the same reason), exact when μ = π_old;
* truncated: where π_old/μ > C the weight stops at C, which biases the gradient towards μ's choices there (the
  share of tokens this cuts is logged as offpolicy/capped) and keeps one rare token from dominating a step;
* the KL term and, for PPO, the critic's regression are estimated on μ's samples (the KL term weighted by the same
  w_t, the critic unweighted).

With one step of staleness and the course's learning rates the ratios sit near 1 (offpolicy/ratio, ratio_max): the
bias is small, and a batch sampled with the current weights (staleness 0) gives weights of exactly 1, the synchronous
update bit for bit. Chapters 7 and 8 take --async; appendix B measures what it gains and costs.

The machinery: `RolloutWorker` starts a process ("spawn": a clean interpreter, no forked thread pools) that builds its
own sampler once (`build(spec)`: the policy's architecture, the frozen reference, the reward), then serves requests:
the trainer sends the current weights (CPU copies: the trainer changes its own in place) and the prompts, the worker
loads them, samples, scores, computes the reference's and its own log-probs, and sends back the Rollout and its random
generator's state (what a checkpoint saves). A failure in the worker comes back as an error naming the worker.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

from llm_from_scratch import distributed
from llm_from_scratch.policy_gradient import Rollout

# one request: (the weights to sample with, this step's prompts) -> (the Rollout, the generator's state after it)
Sampler = Callable[[dict[str, torch.Tensor], list[str]], tuple[Rollout, torch.Tensor]]


def weights_to_send(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's weights on the CPU: the trainer's own change in place at the next optimizer step, and a
    CPU tensor crosses to the other process through shared memory on every platform."""
    return {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}


def next_request(inbox: mp.Queue):
    """The trainer's next request, or None when it says stop or has died (killed: no stop ever comes)."""
    while True:
        try:
            return inbox.get(timeout=1.0)
        except queue.Empty:
            if not mp.parent_process().is_alive():
                return None


def _serve(build: Callable[[Any], Sampler], spec: Any, threads: int, inbox: mp.Queue, results: mp.Queue) -> None:
    """The worker process: build the sampler, then answer requests until a None arrives."""
    for name in distributed.TORCHRUN_VARIABLES:  # a rank's worker is a plain process: no process group of its own
        os.environ.pop(name, None)
    torch.set_num_threads(threads)
    sys.stdout = open(os.devnull, "w")  # the trainer prints the run's story; the worker's own lines would interleave
    try:
        sample = build(spec)
        results.put(("ready", None, None))
        while (request := next_request(inbox)) is not None:
            weights, prompts = request
            ro, stream = sample(weights, prompts)
            results.put(("rollout", ro, stream))
    except BaseException:  # noqa: BLE001 — whatever it was, the trainer must hear of it instead of waiting forever
        results.put(("error", traceback.format_exc(), None))


class RolloutWorker:
    """A process that samples rollouts one request ahead of the trainer.

        with RolloutWorker(build, spec, threads=1) as worker:
            worker.submit(policy, prompts_of(0))              # batch 0, with the weights before any update
            for step in range(steps):
                ro = worker.receive()                         # batch `step`, sampled one update ago
                if step + 1 < steps:
                    worker.submit(policy, prompts_of(step + 1))   # sampled with these weights during the update
                update(policy, ro)

    `build(spec)` runs in the worker and returns the sampler (see `Sampler`); build and spec must be picklable (a
    module-level function and plain values). `stream` is the worker's generator state after the last batch received.
    """

    def __init__(self, build: Callable[[Any], Sampler], spec: Any, threads: int = 1, timeout: float = 7200.0):
        ctx = mp.get_context("spawn")
        self.inbox, self.results = ctx.Queue(), ctx.Queue()
        self.timeout, self.pending, self.stream = timeout, 0, None
        self.process = ctx.Process(target=_serve, args=(build, spec, threads, self.inbox, self.results),
                                   daemon=True, name="rollout-worker")
        self.process.start()
        self._get("ready")  # the sampler is built (models loaded) before the first request

    def submit(self, model: torch.nn.Module, prompts: list[str]) -> None:
        """Ask for the rollout of `prompts` sampled with `model`'s weights as they are now."""
        if self.pending:
            raise RuntimeError("RolloutWorker.submit: one request at a time (receive the last one first)")
        self.inbox.put((weights_to_send(model), list(prompts)))
        self.pending = 1

    def receive(self) -> Rollout:
        """The rollout of the last request (waiting for it); its generator state is then in `self.stream`."""
        if not self.pending:
            raise RuntimeError("RolloutWorker.receive: nothing was submitted")
        ro, self.stream = self._get("rollout")
        self.pending = 0
        return ro

    def _get(self, kind: str) -> tuple[Any, Any]:
        waited = 0.0
        while True:
            try:
                got, value, stream = self.results.get(timeout=1.0)
                break
            except queue.Empty:
                waited += 1.0
                if not self.process.is_alive():
                    raise RuntimeError(f"the rollout worker died (exit code {self.process.exitcode}) before sending "
                                       f"its {kind}") from None
                if waited > self.timeout:
                    raise TimeoutError(f"the rollout worker sent no {kind} in {self.timeout:.0f} s") from None
        if got == "error":
            raise RuntimeError(f"the rollout worker failed:\n{value}")
        return value, stream

    def close(self) -> None:
        """Stop the worker (it finishes the request it is on, which nobody will read)."""
        if self.process.is_alive():
            self.inbox.put(None)
            for _ in range(60):  # drain what it still sends: a process exits only once its queue is flushed
                try:
                    self.results.get(timeout=0.5)
                except queue.Empty:
                    if not self.process.is_alive():
                        break
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
        self.inbox.close()
        self.results.close()

    def __enter__(self) -> RolloutWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
