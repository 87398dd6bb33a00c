"""What the chapter scripts of chapters 5-10 share that is course plumbing, not algorithm.

- The RL tasks (`task_data`): a task's training prompts, its held-out examples (chapter 5's validation set) and its
  gold reward; and the story diagnostics of chapters 7 and 8 (`story_parts`, `top_samples`).
- One RL step's prompts and record (`batch_prompts`, `step_record`).
- A run's life on disk. `flags_record(cfg)`: the flags that decide what a run computes (not where it writes or how
  it prints); `origin(run)`: its seed and the digest of the model it starts from. `finished_result`: the eval.json of
  a finished run of the same flags and origin, which is kept, not trained again. `require_finite_metrics` stops a run
  whose loss is NaN. `resume`: an interrupted run of the same flags and origin continues from its last checkpoint
  (weights, optimizer, RNG, and metrics.jsonl cut back to that step); `save_state` writes that checkpoint.
- The runs a command makes (`runs_of`): one, or with `--seeds N` one per seed, seed k of chapters 7-9 from chapter 5's
  seed k (`sft_seed_sweep`); `spread_table` is the min / median / max over seeds (`gain_rows`: chapters 7 and 8's
  rows); `write_sweep` records the table, the command and the spread.

Every chapter script imports the library, `cli.py` and this module, never another chapter script.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from llm_from_scratch import dataset_files, distributed, gold_rewards, gpt2_weights, lora
from llm_from_scratch.checkpoint import (
    atomic_write_text,
    load_state,
    load_train_state,
    read_jsonl,
    save_tensors,
    save_train_state,
    truncate_metrics,
)
from llm_from_scratch.course import (
    PrerequisiteError,
    finished_run,
    prerequisite,
    require_real,
    runs_root,
    same_cpu_mode,
    shown,
    weights_file_digest,
    write_summary,
)
from llm_from_scratch.data import tinyworld_dir
from llm_from_scratch.sft import SFTBatches
from llm_from_scratch.train import load_gpt, require_finite, save_gpt

# ----------------------------------------------------------------------------- the RL tasks

TASKS = {"word-problems": ("verifiable", "word_problem"), "stories": ("stories", "story")}  # --task -> (set, task)


class TaskData(NamedTuple):
    train_prompts: list[dict]  # the RL prompt set of the task
    held_out: list[dict]  # chapter 5's validation examples of the task
    by_prompt: dict[str, dict]  # the training prompts by their text
    gold_fn: Callable[[list[str], list[str]], list[float]]  # (prompts, completions) -> gold rewards


def task_data(name: str, quick: bool, eval_examples: int) -> TaskData:
    """A task's RL training prompts, its first `eval_examples` held-out examples, the prompts by their text, and the
    gold reward of (prompts, completions) as a reward callable."""
    kind, task = TASKS[name]
    sizes = dataset_files.QUICK_SIZES if quick else {}
    with distributed.main_first():  # under torchrun rank 0 writes missing files, the others then read them
        paths = dataset_files.ensure_datasets(tinyworld_dir(quick), seed=0, **sizes)
    train_prompts = [p for p in read_jsonl(paths[f"rl_{kind}"]) if p["task"] == task]
    held_out = [e for e in read_jsonl(paths["sft_val"]) if e["task"] == task][:eval_examples]
    by_prompt = {p["prompt"]: p for p in train_prompts}

    def gold_fn(prompts, completions):
        return [gold_rewards.gold_reward(by_prompt[p], c) for p, c in zip(prompts, completions)]

    return TaskData(train_prompts, held_out, by_prompt, gold_fn)


def ptx_batches(cfg, quick: bool, tok, context_length: int, seed: int, device):
    """PPO-ptx's data (cfg.ptx_coef > 0; else None): step -> one batch (x, y) of cfg.ptx_batch_size of chapter 5's
    training demonstrations (sft.SFTBatches: the loss on the responses only), a function of (seed, step), so a resumed
    run draws the batches an uninterrupted one would. Every task of the SFT mix is in it: word problems too."""
    if not cfg.ptx_coef:
        return None
    sizes = dataset_files.QUICK_SIZES if quick else {}
    paths = dataset_files.ensure_datasets(tinyworld_dir(quick), seed=0, **sizes)
    batches = SFTBatches(tok, read_jsonl(paths["sft_train"]), context_length, cfg.ptx_batch_size, seed=seed + 7)
    return lambda step: tuple(t.to(device) for t in batches.batch(step))


def story_parts(specs: list[dict], completions: list[str]) -> dict[str, float]:
    """The share of stories that miss the asked name, and that miss the asked colored object: the two parts of the
    gold reward that chapter 6's reward model could not see."""
    parts = [gold_rewards.story_reward_parts(s, c) for s, c in zip(specs, completions)]
    return {"gold/wrong_name": sum(p["name"] == 0 for p in parts) / len(parts),
            "gold/wrong_object": sum(p["object"] < 1 for p in parts) / len(parts)}


def shared_shares(shares: dict[str, float], rows: int) -> dict[str, float]:
    """Shares measured on this rank's `rows` rows, as shares of every rank's rows under torchrun (the ranks' counts
    added up); the shares themselves without torchrun."""
    if distributed.world_size() == 1:
        return shares
    totals = distributed.all_reduce([v * rows for v in shares.values()] + [rows]).tolist()
    return {name: total / totals[-1] for name, total in zip(shares, totals)}


def top_samples(ro, step: int, by_prompt: dict, task: str, n: int = 2) -> list[dict]:
    """The n samples of a rollout that the trained reward liked best, with their gold reward (and, for stories,
    whether they kept the asked name and object): where a policy exploits its reward, these show how."""
    best = torch.argsort(ro.rewards, descending=True)[:n].tolist()
    rows = [{"step": step, "prompt": ro.prompts[i], "completion": ro.completions[i], "proxy": ro.rewards[i].item(),
             "gold": ro.gold[i].item()} for i in best]
    if task == "stories":
        for r in rows:
            parts = gold_rewards.story_reward_parts(by_prompt[r["prompt"]]["spec"], r["completion"])
            r["name_ok"], r["object_ok"] = parts["name"] == 1, parts["object"] == 1
    return rows


def batch_prompts(prompts: list[dict], step: int, n: int) -> list[str]:
    """The n prompts of RL step `step`: the training prompts in order, from the start again when they run out."""
    return [prompts[(step * n + j) % len(prompts)]["prompt"] for j in range(n)]


def step_record(step: int, metrics: dict, ro, rollout_s: float, update_s: float) -> dict:
    """One RL step's metrics.jsonl record: the update's metrics and where the step's time went (the rollout's
    generate / reference / reward seconds, the whole rollout, the update)."""
    return {"step": step, **metrics, **{f"time/{k}_s": v for k, v in ro.seconds.items()},
            "time/rollout_s": rollout_s, "time/update_s": update_s}


def markdown_cell(text: str, width: int = 200) -> str:
    """One markdown table cell: newlines and pipes replaced, cut at `width` characters."""
    return text.replace("\n", " ").replace("|", "/")[:width]


# ----------------------------------------------------------------------------- a run's life on disk

class Run(NamedTuple):
    """Where one run of a chapter goes: a sweep makes one per seed from the same config."""
    out: Path  # the run folder
    seed: int
    init: Path  # the model it starts from (chapter 5's SFT run, or its seed k)
    device: torch.device


@dataclasses.dataclass(frozen=True)
class CommonFlags:
    """The flags of chapters 7-9 that say where a run writes, how it reports, whether it resumes and which seeds a
    sweep runs (cli.add_common_args, cli.add_prerequisite_arg, --no-resume, --seeds): not what a run computes. A
    chapter's Config adds its own flags to these. --fast changes the float32 order (another chain, not another
    recipe): summary.json records the CPU mode, and finished_result keeps a run only in the same mode."""
    no_resume: bool = False
    fast: bool = False
    seeds: int = 0
    device: str = "auto"
    seed: int = 0
    out: Path | None = None
    quick: bool = False
    quiet: bool = False
    debug: bool = False
    no_build: bool = False


@dataclasses.dataclass(frozen=True)
class LoRAFlags:
    """--lora-rank, --lora-alpha, --lora-targets of chapters 7-9 (cli.add_lora_args; appendix A): with a rank, the
    policy trains low-rank adapters on its frozen SFT weights, and its reference is the same network with the
    adapters off (lora.AdaptersOff), not a second copy."""
    lora_rank: int = 0  # 0: every weight trains, and the reference is a second, frozen copy
    lora_alpha: float | None = None  # None: 2 · rank
    lora_targets: str = "all"


@dataclasses.dataclass(frozen=True)
class AsyncFlags:
    """--async, --is-cap, --rollout-threads of chapters 7 and 8 (cli.add_async_args; appendix B): a worker process
    samples each step's batch with the weights before the last update while the trainer updates (async_rollouts.py)."""
    async_rollouts: bool = False
    is_cap: float = 2.0  # C of the truncated importance weights min(π_old / μ, C)
    rollout_threads: int = 0  # the worker's CPU threads (0: half of torch's); the trainer keeps the rest


@dataclasses.dataclass(frozen=True)
class PTXFlags:
    """--ptx-coef, --ptx-batch-size of chapters 7 and 8 (cli.add_ptx_args): PPO-ptx, InstructGPT's remedy for the
    alignment tax (policy_gradient.ptx_loss)."""
    ptx_coef: float = 0.0  # γ: each update minimises L_RL + γ · the SFT loss of one batch of demonstrations
    ptx_batch_size: int = 16


# the fields a run's flags record leaves out: CommonFlags', the model a run starts from (--init; its seed k in a
# sweep), and how many threads the rollout worker gets (its speed, not what it computes)
PLUMBING = (*(f.name for f in dataclasses.fields(CommonFlags)), "init", "rollout_threads")


def flags_record(cfg) -> dict:
    """The config dataclass's fields that decide what a run computes, as JSON values: eval.json keeps them, and a
    finished or interrupted run is reused only when they are the same. A run without LoRA records no LoRA flags, one
    without --async no async flags and one without --ptx-coef no ptx flags, so the runs made before those flags
    existed are still the same runs."""
    flags = {k: v for k, v in dataclasses.asdict(cfg).items()
             if k not in PLUMBING and not (k.startswith("lora_") and not getattr(cfg, "lora_rank", 0))
             and not (k in ("async_rollouts", "is_cap") and not getattr(cfg, "async_rollouts", False))
             and not (k.startswith("ptx_") and not getattr(cfg, "ptx_coef", 0))}
    return json.loads(json.dumps(flags, default=str))


def origin(run: Run) -> dict:
    """What a run starts from besides its flags: its seed and the digest of the weights in run.init (chapter 5's SFT
    model, which may have been trained again since): eval.json and the train state keep it."""
    return {"seed": run.seed, "init": weights_file_digest(run.init)}


def finished_result(cfg, run: Run) -> dict | None:
    """The eval.json of a finished run in run.out with the same flags, seed and starting weights, made in the same CPU
    mode (reproducible or not: summary.json's "cpu"), kept, not trained again; else None; always None under
    --no-resume."""
    out = run.out
    if cfg.no_resume or not same_cpu_mode(finished_run(out)) or not (out / "eval.json").is_file():
        return None
    result = json.loads((out / "eval.json").read_text(encoding="utf-8"))
    if result.get("flags") != flags_record(cfg) or result.get("origin") != origin(run):
        return None
    print(f"seed {run.seed}: keeping the finished run in {shown(out)} (the same flags, seed and starting model; "
          "--no-resume runs it again)")
    return result


def resume(run: Run, cfg, models: dict[str, torch.nn.Module], optimizer: torch.optim.Optimizer,
           logs: tuple[str, ...] = ("metrics.jsonl",)) -> dict | None:
    """Continue an interrupted run in run.out: its last checkpoint's train state (with "step"), after loading into
    each model the weights of `out/last/<file>` (models: file -> module), into the optimizer its state, and the CPU
    RNG; the `logs` (JSONL files of records with a "step") are cut back to that step. None, with the checkpoint and
    the logs removed (nothing else of the folder), under --no-resume, when there is no checkpoint, or when the
    checkpoint is of other flags, another seed or starting model, or an older version of the script.
    Under torchrun rank 0 decides, and alone removes or cuts files; every rank then loads the same checkpoint."""
    out, state_file = run.out, run.out / "last" / "train_state.pt"
    if not distributed.is_main():
        if not distributed.broadcast_object(None):  # rank 0 found no checkpoint to continue, and cleared the folder
            return None
        state = load_train_state(state_file)
        for file, model in models.items():
            load_state(model, out / "last" / file)
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        return state
    state = load_train_state(state_file) if state_file.is_file() and not cfg.no_resume else None
    why = None
    if state is not None and "flags" not in state:
        why = "was made by an older version of this script"
    elif state is not None and state["flags"] != json.dumps(flags_record(cfg)):
        why = "is of other flags"
    elif state is not None and state.get("origin") != json.dumps(origin(run)):
        why = "is of another seed or starting model"
    elif state is not None and state.get("weights") != weights_digests(out / "last", models):
        why = "holds weights its train state was not saved with (a run killed between the two writes)"
    if why:
        print(f"the checkpoint in {shown(out / 'last')} {why}: starting over")
    if why or state is None:
        shutil.rmtree(out / "last", ignore_errors=True)
        for log in logs:
            (out / log).unlink(missing_ok=True)
        distributed.broadcast_object(False)
        return None
    distributed.broadcast_object(True)
    for file, model in models.items():
        load_state(model, out / "last" / file)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    for log in logs:
        truncate_metrics(out / log, state["step"])
    print(f"resuming {shown(out)} at step {state['step']}")
    return state


def policy_and_reference(cfg, run: Run, tok) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The policy, from the SFT model in run.init (dropout off), and the reference of its KL: a second, frozen copy
    of that model; or, with --lora-rank, LoRA adapters on the policy's frozen weights and the same network with the
    adapters off as the reference (lora.AdaptersOff: no second copy of the weights)."""
    policy = load_gpt(run.init, device=run.device, vocab_size=tok.vocab_size, dropout=0.0)
    base = add_lora(cfg, policy)
    if base is not None:
        return policy, base
    reference = load_gpt(run.init, device=run.device, vocab_size=tok.vocab_size, dropout=0.0)
    return policy, reference.requires_grad_(False)


def add_lora(cfg, policy: torch.nn.Module) -> lora.AdaptersOff | None:
    """With --lora-rank: adapters on the policy (in place; everything else frozen), and its base model seen through
    it, the reference (lora.AdaptersOff). Without: None, and the policy as it was."""
    if not cfg.lora_rank:
        return None
    lora.apply_lora(policy, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    layers = lora.adapted_layers(policy)
    trained = sum(p.numel() for p in lora.trainable_parameters(policy))
    print(f"LoRA: rank {cfg.lora_rank}, alpha {next(iter(layers.values())).alpha:g} on {len(layers)} layers "
          f"({cfg.lora_targets}): {trained:,} trained parameters of {policy.num_params():,}; the reference is the "
          "same network with the adapters off")
    return lora.AdaptersOff(policy)


def policy_held(cfg, policy: torch.nn.Module, reference: torch.nn.Module | None) -> dict[str, torch.nn.Module]:
    """The policy and its reference as `ppo.weights_held` counts them: two networks (reference None: not held, its
    log-probs cached), or with --lora-rank one, whose adapters switched off are the reference."""
    if cfg.lora_rank:
        return {"policy + LoRA (adapters off: the reference)": policy}
    return {"policy": policy, **({"reference": reference} if reference is not None else {})}


def last_weights(policy: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """What `out/last/` holds of the policy to resume (file -> module, as `resume` and `save_state` take them): the
    whole model, or of a LoRA policy only its adapters (its frozen weights are run.init's)."""
    return {"adapters.safetensors": lora.Adapters(policy)} if lora.adapted_layers(policy) else {
        "model.safetensors": policy}


def save_last(out: Path, weights: dict[str, torch.nn.Module]) -> None:
    """The weights of `weights` (file -> module) into `out/last/`: written before `save_state`, which records their
    digests."""
    for file, module in weights.items():
        save_tensors(out / "last" / file, module.state_dict())


def save_policy(policy: torch.nn.Module, folder: Path) -> None:
    """The trained policy as a GPT checkpoint, what later chapters load: as it is, or a LoRA policy with its adapters
    folded in (and the adapters alone beside it, adapters.safetensors)."""
    if lora.adapted_layers(policy):
        lora.save_merged(policy, folder)
    else:
        save_gpt(policy, folder)


def require_finite_metrics(metrics: dict, keys: tuple[str, ...], step: int, out: Path) -> None:
    """Stop the run when a loss came out NaN or infinite (train.require_finite), naming the step and the last
    checkpoint in `out/last/` it can resume from (a key missing from `metrics`, a skipped update's, is not checked)."""
    last = out / "last" if (out / "last" / "train_state.pt").is_file() else None
    for key in keys:
        if key in metrics:
            require_finite(metrics[key], key, step, last)


def weights_digests(folder: Path, models: dict[str, torch.nn.Module]) -> dict[str, str | None]:
    """The SHA-256 of each weights file of `models` (file -> module) in `folder` (None for a missing one)."""
    return {file: (hashlib.sha256((folder / file).read_bytes()).hexdigest() if (folder / file).is_file() else None)
            for file in models}


def save_state(run: Run, cfg, step: int, optimizer: torch.optim.Optimizer, models: dict[str, torch.nn.Module],
               **extra) -> None:
    """The train state `resume` reads, written after the weights the chapter saved in `run.out/last/` (models: file ->
    module, as `resume` takes them): the step, the optimizer, the CPU RNG, the flags, the origin (seed, starting
    weights), the digests of those weights files (a kill between the two writes leaves weights `resume` can tell
    apart), and `extra` (tensors and plain values only: it is read with weights_only=True)."""
    out = run.out
    save_train_state(out / "last" / "train_state.pt", {"step": step, "optimizer": optimizer.state_dict(),
                                                        "rng": torch.get_rng_state(),
                                                        "flags": json.dumps(flags_record(cfg)),
                                                        "origin": json.dumps(origin(run)),
                                                        "weights": weights_digests(out / "last", models), **extra})


# ----------------------------------------------------------------------------- seed sweeps


def init_folder(path: Path, quick: bool) -> Path:
    """--init as given: a checkpoint of this course; or a Hugging Face GPT-2 folder (a config.json of model_type
    "gpt2", appendix C), imported once into runs/imported/<its name> (gpt2_weights.import_hf_gpt2: its weights, and
    GPT-2's tokenizer with the course's special tokens and chat template) and started from there."""
    config = Path(path) / "config.json"
    try:
        meta = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
    except json.JSONDecodeError:
        meta = {}  # the checkpoint loader names the broken file
    if not (isinstance(meta, dict) and meta.get("model_type") == "gpt2" and "kind" not in meta):
        return Path(path)
    dst = runs_root(quick) / "imported" / Path(path).resolve().name
    print(f"--init {shown(Path(path))} is a Hugging Face GPT-2 folder: importing it into {shown(dst)} (appendix C; "
          "done once)")
    return gpt2_weights.import_hf_gpt2(path, dst)


def rollout_streams(generator: torch.Generator, key: str = "generator") -> dict:
    """A random stream for the train state: {key: its state} in one process; under torchrun {key + "s": every
    rank's}, gathered on every rank (call it on all of them)."""
    if distributed.world_size() == 1:
        return {key: generator.get_state()}
    return {f"{key}s": distributed.all_gather_objects(generator.get_state())}


def restore_streams(generator: torch.Generator, state: dict, key: str = "generator") -> None:
    """Set the generator to this rank's saved state (rollout_streams); a checkpoint of another number of processes
    cannot be continued stream for stream: the generator then keeps its fresh seed, and rank 0 says so."""
    streams = state.get(f"{key}s") or ([state[key]] if key in state else [])
    if not streams:  # a checkpoint of a synchronous run continued with --async: the worker's stream starts anew
        return
    if len(streams) == distributed.world_size():
        generator.set_state(streams[distributed.rank()])
    elif distributed.is_main():
        print(f"the checkpoint was saved by {len(streams)} process(es), this run has {distributed.world_size()}: the "
              "rollouts' random numbers start anew from the seed")


# ----------------------------------------------------------------------------- rollouts one step ahead (--async)

@dataclasses.dataclass(frozen=True)
class SamplerSpec:
    """What a rollout worker (--async) builds its sampler from: everything chapter 7's and 8's `rollout` calls take
    besides the weights and the prompts, as plain values (it crosses to a fresh process)."""
    init: Path  # the SFT model: the policy's architecture (its weights come with every request) and the reference
    device: str
    task: str
    quick: bool
    reward: str  # "gold" or "rm"
    rm_dir: Path | None  # chapter 6's reward model, when the reward is "rm"
    k: int
    max_new_tokens: int
    temperature: float
    missing_eos_penalty: float
    stream: torch.Tensor  # the sampling generator's state to start from
    lora_rank: int = 0
    lora_alpha: float | None = None
    lora_targets: str = "all"


def build_sampler(spec: SamplerSpec):
    """In the worker process: the policy (LoRA'd as the trainer's), the frozen reference, the reward and the random
    stream, once; returns sample(weights, prompts) -> (a Rollout with the sampler's own log-probs, the stream)."""
    from llm_from_scratch.policy_gradient import rollout  # the worker's imports, not every chapter's
    from llm_from_scratch.reward_model import RewardModel, reward_fn
    from llm_from_scratch.tokenizer import Tokenizer

    tok = Tokenizer.load(spec.init)
    run = Run(spec.init, 0, spec.init, torch.device(spec.device))
    policy, reference = policy_and_reference(spec, run, tok)
    policy.requires_grad_(False)
    data = task_data(spec.task, spec.quick, 0)
    rm = (RewardModel.load(spec.rm_dir, device=run.device, vocab_size=tok.vocab_size).requires_grad_(False)
          if spec.reward == "rm" else None)
    train_fn = data.gold_fn if rm is None else reward_fn(rm, tok)
    generator = torch.Generator(device=run.device)
    generator.set_state(spec.stream)

    def sample(weights: dict[str, torch.Tensor], prompts: list[str]):
        policy.load_state_dict(weights)
        ro = rollout(policy, reference, tok, prompts, spec.k, train_fn, None if rm is None else data.gold_fn,
                     spec.max_new_tokens, spec.temperature, spec.missing_eos_penalty, generator, behaviour=True)
        return ro, generator.get_state()

    return sample


@contextlib.contextmanager
def rollout_worker(cfg, run: Run, rm_dir: Path | None, generator: torch.Generator):
    """With --async: the worker process (async_rollouts.RolloutWorker), starting from `generator`'s state, with
    --rollout-threads CPU threads (default half of this process's) while the trainer keeps the rest; stopped, and the
    threads given back, when the block ends. Without --async: None."""
    if not cfg.async_rollouts:
        yield None
        return
    from llm_from_scratch.async_rollouts import RolloutWorker

    threads_before = torch.get_num_threads()
    threads = cfg.rollout_threads or max(1, threads_before // 2)
    spec = SamplerSpec(run.init, str(run.device), cfg.task, cfg.quick, cfg.reward,
                       rm_dir if cfg.reward == "rm" else None, cfg.k, cfg.max_new_tokens, cfg.temperature,
                       cfg.missing_eos_penalty, generator.get_state(), cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    torch.set_num_threads(max(1, threads_before - threads))
    try:
        with RolloutWorker(build_sampler, spec, threads) as worker:
            if distributed.is_main():
                print(f"--async: a worker process samples each batch with the weights before the last update "
                      f"({threads} CPU thread(s), the trainer {torch.get_num_threads()}); importance weights capped "
                      f"at {cfg.is_cap}")
            yield worker
    finally:
        torch.set_num_threads(threads_before)


def refuse_torchrun(chapter: str) -> None:
    """A one-line error for a chapter whose loop does not yet share its work between processes (appendix B)."""
    if distributed.launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
        raise ValueError(f"{chapter} does not run under torchrun yet (appendix B: chapters 4 to 9 do); run it as one "
                         "process")


def runs_of(cfg, name: str) -> list[Run]:
    """The runs a command makes: one into --out (default runs/<name>) from --init (default chapter 5's SFT run, built
    when missing), or with --seeds N one per seed k into runs/<name>_seeds/seed<k> from chapter 5's seed k."""
    root, device = runs_root(cfg.quick), distributed.setup(cfg.device)  # the process group under torchrun
    if not cfg.seeds:
        with distributed.main_first():  # rank 0 imports or builds the starting model, the others find it
            init = init_folder(cfg.init, cfg.quick) if cfg.init else prerequisite("sft", cfg.quick,
                                                                                   build=not cfg.no_build)
        require_real(init, cfg.quick)
        return [Run(cfg.out or root / name, cfg.seed, init, device)]
    sft_sweep = sft_seed_sweep(root, cfg.seeds)
    sweep_dir = cfg.out or root / f"{name}_seeds"
    return [Run(sweep_dir / f"seed{k}", k, sft_sweep / f"seed{k}", device) for k in range(cfg.seeds)]


def sft_seed_sweep(root: Path, seeds: int) -> Path:
    """Chapter 5's seed sweep, runs/sft_seeds/, where seed k of a later sweep starts; an error naming the command
    that makes it when a seed is missing."""
    sft_sweep = root / "sft_seeds"
    missing = [k for k in range(seeds) if not finished_run(sft_sweep / f"seed{k}")]
    if missing:
        raise PrerequisiteError(f"--seeds {seeds} starts seed k from {shown(sft_sweep)}/seed<k>, and seeds {missing} "
                                f"are not there: run `python chapters/ch05_sft.py --seeds {seeds}` first")
    return sft_sweep


def spread_table(rows: dict[str, tuple[str, list[float], Callable[[float], str]]],
                 first: str = "") -> tuple[str, dict]:
    """rows: key -> (label, one value per seed, format). A markdown table of min / median / max and every seed's
    value, and the spread as {key: {min, median, max, runs}} for summary.json."""
    spread = {k: {"min": min(v), "median": statistics.median(v), "max": max(v), "runs": v}
              for k, (_, v, _) in rows.items()}
    head = f"| {first} |" if first else "| |"
    lines = [f"{head} min | median | max | seeds 0.. |", "|---|---:|---:|---:|---|"]
    for k, (label, _, f) in rows.items():
        s = spread[k]
        lines.append(f"| {label} | {f(s['min'])} | {f(s['median'])} | {f(s['max'])} | {', '.join(map(f, s['runs']))} |")
    return "\n".join(lines), spread


def gain_rows(results: list[dict], name: str, percent: bool = True) -> dict:
    """The rows of an RL sweep's spread table (chapters 7 and 8): the held-out score before and after, the gain, the
    KL, the minutes. percent=False shows the scores as they are (a mean reward, not an accuracy)."""
    before, after = [r["before"]["gold"] for r in results], [r["after"]["gold"] for r in results]
    score = "{:.1%}".format if percent else "{:.3f}".format
    return {"before": (f"held-out {name}, SFT", before, score), "after": (f"held-out {name}, after RL", after, score),
            "gain": ("gain", [a - b for a, b in zip(after, before)],
                     (lambda x: f"{100 * x:+.1f} pts") if percent else "{:+.3f}".format),
            "kl": ("KL (k1, nats/sequence)", [r["kl"] for r in results], "{:.3f}".format),
            "minutes": ("training minutes", [r["seconds"] / 60 for r in results], "{:.1f}".format)}


def write_sweep(sweep_dir: Path, script: str, argv: list[str] | None, text: str, summary: dict, quick: bool) -> None:
    """sweep.md (the command that made the sweep, then its table) and summary.json (which marks the sweep finished) in
    `sweep_dir`, the folder of the seed<k> runs (under torchrun, by rank 0)."""
    if not distributed.is_main():
        return
    command = f"python chapters/{script} {' '.join(sys.argv[1:] if argv is None else argv)}".strip()
    atomic_write_text(sweep_dir / "sweep.md", f"`{command}`\n\n{text}\n")
    write_summary(sweep_dir, summary, quick)
